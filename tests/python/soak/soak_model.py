"""The soak's trainer: a tiny bf16 Qwen3 (names and shapes as Hugging Face writes them, so vLLM
loads it) whose weights are views into one flat buffer, moved by a deterministic sparse step.

Version v's weights are a pure function of (seed, v): version 0 is drawn from the seed, and
step v changes a seeded random ~`share` of all elements by +-1 or +-2 ulps (an RL step's size).
Anyone can therefore recompute any version's bits (the checker, the vLLM subscriber) by replaying
the steps, and a trainer restarted from the store's weights at version L goes on exactly as the
one that was killed would have. Only torch is needed (it runs in both Python environments)."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 250, 64, 96, 2, 4, 2, 32
SHARE = 0.01  # of all elements changed per version


def emit(**event) -> None:
    """One event of a soak process, a JSON line on stdout for the driver (soak.py)."""
    print(json.dumps(event), flush=True)


def soak_arguments() -> argparse.ArgumentParser:
    """The arguments every soak process takes: the store, the trainer's seed, the versions."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--versions", type=int, required=True)
    return ap


def config() -> dict:
    """config.json of the checkpoint (a Qwen3ForCausalLM as transformers would write it)."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "use_cache": True}


def shapes() -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (HIDDEN,)),
                (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
                (p + "self_attn.q_norm.weight", (HEAD_DIM,)),
                (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
                (p + "post_attention_layernorm.weight", (HIDDEN,)),
                (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
                (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
                (p + "mlp.down_proj.weight", (HIDDEN, INTER))]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


class Trainer:
    """The weights (`tensors`: name -> bf16 view into `flat`) at `version`."""

    def __init__(self, seed: int):
        self.seed = seed
        layout = shapes()
        total = sum(torch.Size(s).numel() for _, s in layout)
        g = torch.Generator().manual_seed(seed)
        self.flat = (torch.randn(total, generator=g) * 0.5).to(torch.bfloat16)
        self.bits = self.flat.view(torch.int16)
        self.tensors: dict[str, torch.Tensor] = {}
        at = 0
        for name, shape in layout:
            n = torch.Size(shape).numel()
            self.tensors[name] = self.flat[at:at + n].view(shape)
            at += n
        self.version = 0

    def step(self) -> None:
        """Moves the weights to version + 1."""
        v = self.version + 1
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + v)
        n = self.bits.numel()
        pick = torch.randint(0, n, (max(1, int(n * SHARE)),), generator=g)
        moves = torch.tensor([-2, -1, 1, 2], dtype=torch.int16)[torch.randint(0, 4, (pick.numel(),), generator=g)]
        self.bits[pick] += moves  # a position drawn twice moves once: still a function of (seed, v)
        self.version = v

    def advance_to(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"cannot replay backwards from {self.version} to {version}")
        while self.version < version:
            self.step()

    def sha256(self) -> str:
        return hashlib.sha256(self.flat.view(torch.uint8).numpy().tobytes()).hexdigest()

    def save_checkpoint(self, folder: Path) -> Path:
        """config.json + model.safetensors of the current version (what vLLM loads)."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config()))
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        return folder


def sha256_of(tensors: dict[str, torch.Tensor]) -> str:
    """The hash Trainer.sha256 gives for the same bits, of tensors in the trainer's order."""
    h = hashlib.sha256()
    for name, _ in shapes():
        h.update(tensors[name].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
