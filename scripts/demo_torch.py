#!/usr/bin/env python3
"""End-to-end PyTorch demo of deltasync.

A small Qwen2-shaped language model (byte-level, built locally) is trained for real steps with
AdamW at an RL-sized learning rate on fp32 master weights; after every step its bf16 inference
copy is published through a folder store with deltasync.DeltaPublisher. Two followers track it:
  - a DeltaSubscriber updating a plain PyTorch copy of the bf16 weights in place;
  - a stand-in vLLM engine at tensor-parallel size 2 (tests/python/vllm_standin.py: fused
    qkv / gate_up, row- and column-sharded weights, padded vocabulary) running
    deltasync.vllm.DeltaWorkerExtension on each rank.
After every step both must be bit-identical to the trainer (the vLLM ranks to what vLLM's own
full reload would produce). Per step it prints sparsity, bytes and times.

    python scripts/demo_torch.py [--steps 20] [--lr 1e-6] [--store /tmp/folder] [--tp 2]
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import deltasync
from deltasync.vllm import DeltaWorkerExtension

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
import vllm_standin as vs  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, c: vs.Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=True)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=True)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=True)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: vs.Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c.hidden_size), RMSNorm(c.hidden_size)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyQwen(nn.Module):
    """Hugging Face parameter names (model.layers.N.self_attn.q_proj.weight, ...)."""

    def __init__(self, c: vs.Config):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.model.norm = RMSNorm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def batches(text: bytes, seq: int, batch: int, seed: int):
    data = torch.tensor(list(text), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (RL-sized)")
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--store", help="folder for the store (default: a temporary folder)")
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()

    # A model this small gains nothing from intra-op threads, and on a busy machine OpenMP
    # barriers waiting for descheduled threads would dominate the millisecond timings printed.
    torch.set_num_threads(1)
    config = vs.Config(vocab_size=256, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=384, num_layers=2, qkv_bias=True)
    torch.manual_seed(0)
    master = TinyQwen(config)  # fp32 master weights, what AdamW updates
    optimizer = torch.optim.AdamW(master.parameters(), lr=args.lr, weight_decay=0.0)
    # The bf16 inference copy: what is published (and what a trainer would hand to vLLM).
    published = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in master.named_parameters()}
    n_elements = sum(t.numel() for t in published.values())

    tmp = None
    if args.store is None:
        tmp = tempfile.TemporaryDirectory(prefix="deltasync-demo-")
        args.store = tmp.name
    store = f"file://{Path(args.store).absolute()}"
    print(f"deltasync demo: {n_elements / 1e6:.2f}M bf16 parameters, AdamW lr={args.lr}, store {store}")

    follower = {n: torch.zeros_like(t) for n, t in published.items()}
    subscriber = deltasync.DeltaSubscriber(follower, store=store)
    Worker = vs.make_worker_class(DeltaWorkerExtension)
    workers = [Worker(vs.StandinForCausalLM(config, vs.TP(r, args.tp)), rank=r) for r in range(args.tp)]
    text = Path(__file__).read_bytes() + Path(deltasync.__file__).read_bytes()
    data = batches(text, seq=64, batch=16, seed=0)

    ok = True
    with deltasync.DeltaPublisher(published, store=store, anchor_every=args.anchor_every) as pub:
        pub.publish(0)
        pub.flush()
        subscriber.update()
        init = [w.deltasync_init(store) for w in workers]
        print(f"vLLM stand-in TP={args.tp}: index maps {init[0]['index_map']} "
              f"({init[0]['index_map_bytes']} B per rank), learned in {init[0]['learn_seconds'] * 1e3:.0f} ms")
        print(f"{'step':>4} {'loss':>7} {'changed':>8} {'sparsity':>8} {'bytes':>9} {'B/chg':>6} "
              f"{'stage ms':>8} {'upload ms':>9} {'sub ms':>7} {'sub pause':>9} {'vllm pause':>10}  identical")
        for step in range(1, args.steps + 1):
            tokens, targets = next(data)
            loss = nn.functional.cross_entropy(master(tokens).reshape(-1, config.vocab_size), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for n, p in master.named_parameters():
                    published[n].copy_(p)  # round to bf16: most elements keep their bits
            stats = pub.publish(step)
            pub.flush()
            t0 = time.perf_counter()
            subscriber.update()
            sub_ms = (time.perf_counter() - t0) * 1e3
            reports = [w.deltasync_update() for w in workers]
            same = all(bits_equal(follower[n], published[n]) for n in published)
            for r, w in enumerate(workers):
                expected = vs.reference_runtime_params(config, vs.TP(r, args.tp), published)
                got = dict(w.model_runner.model.named_parameters())
                same = same and all(bits_equal(got[n].detach(), e) for n, e in expected.items())
            ok = ok and same
            nbytes = stats.delta_bytes + stats.anchor_bytes
            per_changed = stats.delta_bytes / stats.changed_elements if stats.changed_elements else math.nan
            kind = " (anchor)" if stats.anchor else ""
            print(f"{step:>4} {loss.item():>7.3f} {stats.changed_elements:>8} {stats.sparsity:>8.2%} {nbytes:>9} "
                  f"{per_changed:>6.2f} {stats.stage_seconds * 1e3:>8.2f} {stats.upload_seconds * 1e3:>9.2f} "
                  f"{sub_ms:>7.2f} {subscriber.last_report.pause_seconds * 1e3:>9.3f} "
                  f"{max(r['pause_seconds'] for r in reports) * 1e3:>10.3f}  {'yes' if same else 'NO'}{kind}")
    full = n_elements * 2
    deltas = [s for s in pub.stats if s.version > 0 and not s.anchor]
    if deltas:
        mean = sum(s.delta_bytes for s in deltas) / len(deltas)
        print(f"mean delta {mean / 1e3:.1f} kB vs {full / 1e3:.1f} kB full bf16 weights ({full / mean:.0f}x smaller)")
    print("bit-identical at every step" if ok else "MISMATCH")
    if tmp is not None:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
