"""Publish and subscribe through the Python package on a Qwen3-0.6B-shaped bf16 model at ~1%
changed per step (CPU tensors, folder store): trainer-visible publish time, publish-to-visible
time, subscriber update time, and what the reports count (bytes per changed element moved
between host and device, host synchronizations per step).

Runs against whichever `deltasync` package Python imports, so one script measures an old build
and a new one in the same session:

    python benchmarks/pubsub_python.py --steps 5 --out results.json

Fields a package's reports lack are printed as '-'. The model is random bits (only their
changes matter); each step flips the low bits of a random 1% of every tensor's elements.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import deltasync


def qwen3_0_6b_shapes(layers: int = 28) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, vocab, q, kv = 1024, 3072, 151936, 16 * 128, 8 * 128
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "self_attn.q_proj.weight", (q, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                   (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, q)),
                   (p + "self_attn.q_norm.weight", (128,)), (p + "self_attn.k_norm.weight", (128,)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter))]
    shapes.append(("model.norm.weight", (hidden,)))
    return shapes


def random_model(shapes, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(-2**15, 2**15, s, generator=g, dtype=torch.int16).view(torch.bfloat16) for n, s in shapes}


def step(model: dict[str, torch.Tensor], share: float, seed: int) -> int:
    """Flips low bits of `share` of each tensor's elements (an optimizer-like sparse change)."""
    g = torch.Generator().manual_seed(seed)
    changed = 0
    for t in model.values():
        flat = t.view(-1).view(torch.int16)
        k = max(1, int(flat.numel() * share))
        pos = torch.randint(0, flat.numel(), (k,), generator=g).to(t.device)
        flat[pos] ^= torch.randint(1, 8, (k,), generator=g, dtype=torch.int16).to(t.device)
        changed += k
    if any(t.is_cuda for t in model.values()):
        torch.cuda.synchronize()  # the step is the trainer's work, not the publisher's
    return changed


def field(obj, name):
    return getattr(obj, name, None) if obj is not None else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--share", type=float, default=0.01)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--device", default="cpu", help="where the trainer's and the follower's tensors live (cpu, cuda)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    shapes = qwen3_0_6b_shapes(args.layers)
    trainer = {n: t.to(args.device) for n, t in random_model(shapes, 0).items()}
    follower = {n: t.clone() for n, t in trainer.items()}
    elements = sum(t.numel() for t in trainer.values())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{tmp}/store"
        pub = deltasync.DeltaPublisher(trainer, store=store, anchor_every=1000, **(
            {"anchor_share": 1e9} if "anchor_share" in deltasync.DeltaPublisher.__init__.__code__.co_varnames else {}))
        sub = deltasync.DeltaSubscriber(follower, store=store)
        t0 = time.perf_counter()
        pub.publish(0)
        anchor_staged = time.perf_counter() - t0
        pub.flush()
        anchor_visible = time.perf_counter() - t0
        t1 = time.perf_counter()
        sub.update()
        anchor_subscribe = time.perf_counter() - t1
        for s in range(1, args.steps + 1):
            changed = step(trainer, args.share, s)
            t0 = time.perf_counter()
            stats = pub.publish(s)
            staged = time.perf_counter() - t0
            pub.flush()
            visible = time.perf_counter() - t0
            if args.device != "cpu":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            sub.update()
            subscribe = time.perf_counter() - t1
            rep = sub.last_report
            ok = all(torch.equal(trainer[n].view(torch.int16), follower[n].view(torch.int16)) for n in trainer)
            last = pub.last_report if hasattr(pub, "last_report") else stats
            rows.append(dict(step=s, changed=changed, delta_bytes=field(last, "delta_bytes") or field(stats, "delta_bytes"),
                             publish_ms=staged * 1e3, visible_ms=visible * 1e3, subscribe_ms=subscribe * 1e3,
                             pause_ms=(field(rep, "pause_seconds") or 0) * 1e3,
                             pub_h2d=field(last, "host_to_device_bytes"), pub_d2h=field(last, "device_to_host_bytes"),
                             pub_syncs=field(last, "host_syncs"), sub_h2d=field(rep, "host_to_device_bytes"),
                             sub_d2h=field(rep, "device_to_host_bytes"), sub_syncs=field(rep, "host_syncs"),
                             bit_identical=ok))
        pub.close()

    print(f"package {Path(deltasync.__file__).parent}, {elements / 1e6:.1f}M bf16 elements on {args.device}, "
          f"{args.share:.1%} changed per step")
    print(f"anchor (version 0): publish {anchor_staged * 1e3:.1f} ms, visible {anchor_visible * 1e3:.1f} ms, "
          f"subscribe {anchor_subscribe * 1e3:.1f} ms")
    cols = ["step", "changed", "delta_bytes", "publish_ms", "visible_ms", "subscribe_ms", "pause_ms",
            "pub_syncs", "sub_syncs", "bit_identical"]
    print(" ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>13.1f}" if isinstance(r[c], float) else f"{str(r[c] if r[c] is not None else '-'):>13}" for c in cols))
    med = {k: statistics.median(r[k] for r in rows) for k in ("publish_ms", "visible_ms", "subscribe_ms", "pause_ms")}
    print("median: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    if args.out:
        args.out.write_text(json.dumps(dict(package=str(Path(deltasync.__file__).parent), elements=elements,
                                            share=args.share, rows=rows, median=med,
                                            anchor_ms=dict(publish=anchor_staged * 1e3, visible=anchor_visible * 1e3,
                                                           subscribe=anchor_subscribe * 1e3)), indent=1))
    differ = [r["step"] for r in rows if not r["bit_identical"]]
    if differ:
        sys.exit(f"the follower's weights differ from the trainer's after step(s) {differ}")


if __name__ == "__main__":
    main()
