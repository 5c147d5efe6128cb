"""The demo's model and task: a tiny random Qwen3 (595k bf16 parameters; sizes vLLM-CPU's kernels
accept: head_dim 32, widths multiples of 32) with the TRL tests' word-level tokenizer, prompts and rule-based reward
(tests/python/trl_tiny.py: reward = share of "a" among the completion's words). Nothing is
downloaded: the base checkpoint is made here and both processes start from it."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))
import trl_tiny  # noqa: E402

# bf16 weights trained in place by AdamW: at this rate most updates round away in bf16 (a few
# tens of percent of the elements change on the first step, fewer later), as in RL fine-tuning.
LEARNING_RATE = 2e-5


def prompts():
    return trl_tiny.prompts_dataset(64)


def reward(completions, **kwargs):
    return trl_tiny.reward_letter_a(completions, **kwargs)


def make_base(path: Path, seed: int = 0, tokenizer=None) -> Path:
    """The checkpoint both sides start from (config, model.safetensors, tokenizer; by default the
    TRL tests' word-level one)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tokenizer or trl_tiny.make_tokenizer()
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, torch_dtype="bfloat16")
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


# ---- the conversational twin, for TRL's AsyncGRPOTrainer (its rollout worker renders messages) ----

CHAT_MARKERS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_VOCAB = trl_tiny.SPECIALS + CHAT_MARKERS + trl_tiny.WORDS + ["user", "assistant"]


def make_chat_tokenizer():
    """The word-level tokenizer with Qwen3's chat template (as TRL ships it, so TRL knows how to
    parse its responses) and the template's words and markers in the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    vocab = {tok: i for i, tok in enumerate(CHAT_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                        unk_token="<unk>", additional_special_tokens=CHAT_MARKERS)
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.padding_side = "left"
    return tokenizer


def chat_prompts(n: int = 64):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say the letter {trl_tiny.WORDS[i % 4]}"}]
                                         for i in range(n)]})


def chat_reward(completions, completion_ids, **kwargs):
    """The share of "a" among each completion's tokens (the token IDs: the word-level tokenizer's
    decoded text has no spaces between words)."""
    a = CHAT_VOCAB.index("a")
    return [sum(t == a for t in ids) / max(len(ids), 1) for ids in completion_ids]


def token_parity_reward(completions, completion_ids, **kwargs):
    """The share of even token IDs in each completion: a reward a random-init model with a large
    vocabulary already varies on (it almost never samples the tokenizer's few words, so
    chat_reward would be 0 for every completion, every advantage 0 and no weight would move)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
