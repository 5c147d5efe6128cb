"""Bytes each tensor-parallel rank reads of a compact delta (ranged reads, docs/stores.md "Ranged
reads") at TP=1 and TP=2, on a Qwen3-0.6B-shaped tensor table (vocabulary 151936, hidden 1024,
16 query / 8 KV heads of 128, intermediate 3072, 28 layers, tied embeddings):

    python benchmarks/ranged_fetch.py [--layers 28] [--share 0.01] [--blocks 16384,2048]

The receivers are the vLLM worker extension's real C++ mapped receiver over the test stand-in of
vLLM's parallel layers (tests/python/vllm_standin.py: column-parallel q/k/v and gate/up split on
dim 0, row-parallel o_proj/down_proj split on dim 1, vocabulary-parallel embeddings, replicated
norms), ranks on threads over gloo, against a folder store; the figures are the receivers' own
SyncReport.bytes_fetched and delta_bytes. Per block size (--blocks: compact_block_elements), three
deltas each changing --share of the elements by one ulp: of every tensor, of the row-parallel
tensors only, of the other tensors only -- which shows where a rank's bytes go.
Prints one Markdown table.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
import vllm_standin as vs  # noqa: E402

import deltasync  # noqa: E402
from deltasync.vllm import DeltaWorkerExtension  # noqa: E402

ROW_PARALLEL = ("o_proj", "down_proj")


def change(model, share: float, seed: int, which) -> int:
    g = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not which(name):
                continue
            bits = p.view(-1).view(torch.int16)
            pick = (torch.rand(bits.numel(), generator=g) < share).nonzero().reshape(-1)
            bits[pick] += 1
            changed += pick.numel()
    return changed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--share", type=float, default=0.01)
    ap.add_argument("--blocks", default="16384,2048")
    args = ap.parse_args()
    config = vs.Config(vocab_size=151936, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=3072, num_layers=args.layers, tie_word_embeddings=True, qkv_bias=False)
    worker_cls = vs.make_worker_class(DeltaWorkerExtension)
    trainer = vs.HFModel(config, seed=0)
    params = sum(p.numel() for p in trainer.parameters())
    deltas = [("every tensor", lambda n: True),
              ("row-parallel only (o_proj, down_proj)", lambda n: any(k in n for k in ROW_PARALLEL)),
              ("all but row-parallel", lambda n: not any(k in n for k in ROW_PARALLEL))]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ranged-fetch-") as tmp:
        for blocks in (int(b) for b in args.blocks.split(",")):
            store = f"file://{tmp}/b{blocks}"
            with deltasync.DeltaPublisher(trainer, store=store, anchor_every=0, compact_block_elements=blocks) as pub:
                pub.publish(0)
                pub.flush()
                tp = {n: vs.make_workers(worker_cls, config, n) for n in (1, 2)}
                for workers in tp.values():
                    vs.on_all_ranks(workers, "deltasync_init", store)
                for k, (label, which) in enumerate(deltas, start=1):
                    changed = change(trainer, args.share, 1000 * blocks + k, which)
                    pub.publish(k)
                    pub.flush()
                    for n, workers in tp.items():
                        t0 = time.perf_counter()
                        reports = vs.on_all_ranks(workers, "deltasync_update")
                        seconds = time.perf_counter() - t0
                        whole = reports[0]["delta_bytes"]
                        fetched = [r["bytes_fetched"] for r in reports]
                        rows.append((blocks, label, changed, n, whole, fetched, seconds))
                        print(f"blocks {blocks} {label} TP={n}: delta {whole} fetched {fetched} ({seconds:.1f} s)",
                              file=sys.stderr, flush=True)
                del tp
    print(f"Qwen3-0.6B-shaped table, {args.layers} layers, {params / 1e6:.0f}M parameters, bf16; "
          f"each delta changes {args.share:.0%} of the elements of the tensors named by one ulp.\n")
    print("| block elements | delta changes | changed | TP | delta bytes | bytes per rank | share per rank |")
    print("|---|---|---|---|---|---|---|")
    for blocks, label, changed, n, whole, fetched, _ in rows:
        per = " / ".join(f"{f:,}" for f in fetched)
        share = " / ".join(f"{f / whole:.3f}" for f in fetched)
        print(f"| {blocks} | {label} | {changed:,} | {n} | {whole:,} | {per} | {share} |")


if __name__ == "__main__":
    main()
