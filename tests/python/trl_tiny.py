"""A tiny Qwen-style causal LM with random weights and a word-level tokenizer built locally (no
downloads), and a rule-based reward: what the TRL tests train on CPU."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

WORDS = ["a", "b", "c", "d", "yes", "no", "count", "say", "the", "letter"]
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def make_tokenizer():
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def make_model(tokenizer, seed=0, dtype=torch.bfloat16):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return Qwen2ForCausalLM(config).to(dtype)


def prompts_dataset(n=16):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"say the letter {WORDS[i % 4]}" for i in range(n)]})


def reward_letter_a(completions, **kwargs):
    """Rule-based: the share of the completion's words that are "a"."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w == "a" for w in words) / max(len(words), 1))
    return out
