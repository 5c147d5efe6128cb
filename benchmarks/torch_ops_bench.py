#!/usr/bin/env python3
"""torch.ops.deltasync encode / apply against the torch eager equivalents, in one run.

    python benchmarks/torch_ops_bench.py [--scale 0.5] [--density 0.01] [--device cpu|cuda] [--threads N]

Eager encode = per tensor `ne` + `nonzero` + `index_select` (+ `index_copy_` into the shadow, so
both sides leave the shadow up to date); eager apply = per tensor `index_copy_`. Also prints a
same-run copy (`shadow.copy_(current)`) of the whole model as the memory-bandwidth yardstick.
Times are the best of --repeat runs; the model is Qwen3-0.6B's list of 311 bf16 tensors, scaled.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _threads_from_argv() -> int | None:
    # DELTASYNC_THREADS must be set before the library starts its pool (at import).
    if "--threads" in sys.argv:
        return int(sys.argv[sys.argv.index("--threads") + 1])
    return None


if _threads_from_argv():
    os.environ["DELTASYNC_THREADS"] = str(_threads_from_argv())

import torch  # noqa: E402

import deltasync  # noqa: E402
from deltasync import ops  # noqa: E402

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def model_shapes(scale: float) -> list[tuple[int, ...]]:
    """Qwen3-0.6B's tensor list (311 tensors: embedding, 28 layers of q/k/v/o, gate/up/down, four
    norms, final norm) with every matrix dimension multiplied by `scale` (1.0: 0.6B elements)."""
    d = lambda x: max(1, int(x * scale))  # noqa: E731
    hidden, inter, q, kv, vocab, head = d(1024), d(3072), d(2048), d(1024), d(151936), 128
    shapes = [(vocab, hidden)]
    for _ in range(28):
        shapes += [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden),
                   (hidden, inter), (hidden,), (hidden,), (head,), (head,)]
    shapes.append((hidden,))
    return shapes


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def best_of(fn, setup, repeat, device):
    best = float("inf")
    for _ in range(repeat):
        setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def eager_encode(current, shadow):
    indices, values, counts = [], [], []
    for cur, sh in zip(current, shadow):
        c, s = cur.view(-1).view(INT[cur.element_size()]), sh.view(-1).view(INT[sh.element_size()])
        idx = torch.ne(c, s).nonzero().reshape(-1)
        v = c.index_select(0, idx)
        s.index_copy_(0, idx, v)
        indices.append(idx)
        values.append(v)
        counts.append(idx.numel())
    return indices, values, counts


def eager_apply(targets, indices, values):
    for t, idx, v in zip(targets, indices, values):
        t.view(-1).view(INT[t.element_size()]).index_copy_(0, idx, v)


def vllm_pause(args, device) -> dict:
    """Inference-side pause of the vLLM worker extension (rank 0 of a TP group) on the stand-in
    from tests/python/vllm_standin.py, Qwen3-0.6B-shaped (dims x --scale), --density changed."""
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
    import vllm_standin as vs
    from deltasync.vllm import DeltaWorkerExtension

    d = lambda x, m=64: max(m, int(x * args.scale) // m * m)  # noqa: E731  (TP-divisible sizes)
    config = vs.Config(vocab_size=d(151936), hidden_size=d(1024), num_heads=16, num_kv_heads=8,
                       head_dim=d(128, 16), intermediate_size=d(3072), num_layers=28, qkv_bias=False, tie_word_embeddings=True)
    trainer = vs.HFModel(config)
    worker = vs.make_worker_class(DeltaWorkerExtension)(
        vs.StandinForCausalLM(config, vs.TP(0, args.vllm_tp)).to(device), rank=0)
    g = torch.Generator().manual_seed(1)
    pauses, report = [], {}
    with tempfile.TemporaryDirectory() as folder, deltasync.DeltaPublisher(trainer, store=folder) as pub:
        pub.publish(0)
        pub.flush()
        init = worker.deltasync_init(folder)
        for version in range(1, args.repeat + 1):
            with torch.no_grad():
                for p in trainer.parameters():
                    flat = p.view(-1).view(torch.int16)
                    flat[torch.rand(flat.shape, generator=g) < args.density] += 1
            pub.publish(version)
            pub.flush()
            report = worker.deltasync_update()
            pauses.append(report["pause_seconds"])
    n = sum(p.numel() for p in trainer.parameters())
    print(f"  vLLM stand-in TP={args.vllm_tp} rank 0, {n / 1e6:.0f}M HF elements: index maps "
          f"{init['index_map_bytes'] / 1e3:.1f} kB learned in {init['learn_seconds']:.1f} s; update of "
          f"{report['changed_elements']} changed ({report['bytes_fetched'] / 1e6:.1f} MB): pause {min(pauses) * 1e3:.2f} ms "
          f"(best of {len(pauses)}), whole update {report['total_seconds'] * 1e3:.1f} ms")
    return {"vllm_tp": args.vllm_tp, "vllm_pause_s": min(pauses), "vllm_update_s": report["total_seconds"],
            "vllm_index_map_bytes": init["index_map_bytes"], "vllm_learn_s": init["learn_seconds"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.5, help="matrix dims x scale of Qwen3-0.6B (0.5: 150M elements)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="threads for both sides (torch intra-op and deltasync's pool)")
    ap.add_argument("--vllm-tp", type=int, default=0,
                    help="also measure the vLLM worker extension's update pause on the stand-in at this TP size")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    shapes = model_shapes(args.scale)
    base = [(torch.randn(s, generator=g) * 0.05).to(torch.bfloat16).to(device) for s in shapes]
    current = []
    for b in base:
        c = b.clone()
        flat = c.view(-1).view(torch.int16)
        mask = (torch.rand(flat.shape, generator=g) < args.density).to(device)
        flat[mask] += 1  # one ulp, like an Adam step at an RL learning rate
        current.append(c)
    shadow = [b.clone() for b in base]
    n = sum(t.numel() for t in base)
    nbytes = n * 2

    def reset():
        for s, b in zip(shadow, base):
            s.copy_(b)

    results = {"device": str(device), "elements": n, "tensors": len(base), "density": args.density,
               "threads": torch.get_num_threads(), "ops_library": str(deltasync.library_path())}
    results["copy_s"] = best_of(lambda: [s.copy_(c) for s, c in zip(shadow, current)], reset, args.repeat, device)
    results["encode_ops_s"] = best_of(lambda: ops.encode(current, shadow), reset, args.repeat, device)
    results["encode_eager_s"] = best_of(lambda: eager_encode(current, shadow), reset, args.repeat, device)
    reset()
    indices, values, counts = ops.encode(current, shadow)
    e_idx, e_val, _ = eager_encode(current, [b.clone() for b in base])
    targets = [b.clone() for b in base]
    results["changed"] = int(counts.sum())
    results["apply_ops_s"] = best_of(lambda: ops.apply(targets, indices, values, counts), lambda: None, args.repeat, device)
    results["apply_eager_s"] = best_of(lambda: eager_apply(targets, e_idx, e_val), lambda: None, args.repeat, device)
    # Inference-side pause: the delta arrives in (pinned) host memory; copy it to the device and
    # scatter it into the weights.
    pin = device.type == "cuda"
    h_idx, h_val = indices.cpu(), values.cpu()
    if pin:
        h_idx, h_val = h_idx.pin_memory(), h_val.pin_memory()
    h_counts = counts.cpu()

    def pause():
        ops.apply(targets, h_idx.to(device, non_blocking=True), h_val.to(device, non_blocking=True), h_counts)

    results["pause_s"] = best_of(pause, lambda: None, args.repeat, device)
    for t, c in zip(targets, current):
        assert torch.equal(t.view(torch.int16), c.view(torch.int16))
    results["encode_speedup"] = results["encode_eager_s"] / results["encode_ops_s"]
    results["apply_speedup"] = results["apply_eager_s"] / results["apply_ops_s"]
    read = 2 * nbytes
    print(f"model: {n / 1e6:.1f}M bf16 elements in {len(base)} tensors, {results['changed']} changed "
          f"({args.density:.2%}), device {device}, {results['threads']} torch threads")
    print(f"  copy (yardstick)      {results['copy_s'] * 1e3:8.2f} ms  {read / results['copy_s'] / 1e9:6.2f} GB/s (read+write)")
    print(f"  encode  deltasync     {results['encode_ops_s'] * 1e3:8.2f} ms  {read / results['encode_ops_s'] / 1e9:6.2f} GB/s read")
    print(f"  encode  torch eager   {results['encode_eager_s'] * 1e3:8.2f} ms  -> deltasync {results['encode_speedup']:.1f}x faster")
    print(f"  apply   deltasync     {results['apply_ops_s'] * 1e3:8.2f} ms")
    print(f"  apply   torch eager   {results['apply_eager_s'] * 1e3:8.2f} ms  -> deltasync {results['apply_speedup']:.1f}x faster")
    print(f"  pause (host->device + apply) {results['pause_s'] * 1e3:8.2f} ms "
          f"for {(h_idx.numel() * 8 + h_val.numel()) / 1e6:.1f} MB of delta")
    if args.vllm_tp:
        results.update(vllm_pause(args, device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
