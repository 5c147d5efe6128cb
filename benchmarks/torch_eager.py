#!/usr/bin/env python3
"""Torch eager baseline for deltasync-bench: what a user writes today without deltasync.

encode: per tensor, ``mask = curr.ne(shadow)``, ``idx = mask.nonzero()``, ``vals =
curr.index_select(0, idx)``, ``base = shadow.index_select(0, idx)``, ``shadow.index_copy_(0, idx,
vals)`` -- the same outputs as deltasync's encode (positions, new bits, old bits, shadow updated).
apply: per tensor, ``target.index_copy_(0, idx, vals)`` with int64 indices (index_copy_ needs them).

Tensors are compared as integer views of their bits (int8/int16/int32), as deltasync does: a float
``ne`` would call NaN != NaN a change and -0.0 == +0.0 none.

deltasync-bench runs this script with ``--request FILE --output FILE``: the request names each state
(benchmark, device, tensor sizes, element width, changed share) and the sampling policy; the output
holds one row per state in the binary's units (seconds, elements, bytes). Exit status 3: torch is not
importable (the binary reports the rows as skipped).
"""
import argparse
import json
import statistics
import sys
import time

INT_DTYPE_NAMES = {1: "int8", 2: "int16", 4: "int32"}


def relative_spread(samples):
    """1.4826 x median absolute deviation / median: the binary's noise measure."""
    if len(samples) < 2:
        return 0.0
    m = statistics.median(samples)
    mad = statistics.median(abs(x - m) for x in samples)
    return 1.4826 * mad / m if m > 0 else 0.0


def sample_until_done(run_one, policy):
    """One warm-up, then samples until min_samples with low noise, the timeout, or max_samples."""
    run_one()
    samples = []
    start = time.perf_counter()
    while True:
        samples.append(run_one())
        n = len(samples)
        if n >= policy["max_samples"]:
            break
        if time.perf_counter() - start >= policy["timeout_s"]:
            break
        if n >= policy["min_samples"] and relative_spread(samples) <= policy["max_noise"]:
            break
    return samples


class Timer:
    """Seconds of a region: perf_counter on the CPU, CUDA events (after a synchronize) on the GPU."""

    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = device == "cuda"
        self.flush = None
        if self.cuda:
            l2 = torch.cuda.get_device_properties(0).L2_cache_size
            # Writing twice the L2 evicts whatever the previous sample left there (cold samples).
            self.flush = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device="cuda")

    def time(self, fn):
        torch = self.torch
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        self.flush.zero_()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def make_model(torch, sizes, width, share, device, seed):
    """Random weight bits (never zeros) and a shadow differing at Bernoulli(share) positions by one unit."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, INT_DTYPE_NAMES[width])
    info = torch.iinfo(dtype)
    current, shadow, changed = [], [], 0
    for n in sizes:
        cur = torch.randint(info.min, info.max, (n,), generator=gen, dtype=dtype)
        mask = torch.rand(n, generator=gen) < share
        sh = cur.clone()
        sh[mask] = sh[mask] + 1  # integer add wraps: the bits always change
        changed += int(mask.sum())
        current.append(cur.to(device))
        shadow.append(sh.to(device))
    return current, shadow, changed


def bench_encode(torch, state, policy, timer):
    sizes, width, share, device = state["tensor_sizes"], state["width"], state["changed_share"], state["device"]
    current, shadow, changed = make_model(torch, sizes, width, share, device, 1)
    last = []  # (tensor, idx, base) of the previous sample, to put the shadow back

    def encode():
        out = []
        for t, (cur, sh) in enumerate(zip(current, shadow)):
            idx = cur.ne(sh).nonzero().squeeze(1)
            vals = cur.index_select(0, idx)
            base = sh.index_select(0, idx)
            sh.index_copy_(0, idx, vals)
            out.append((t, idx, vals, base))
        return out

    def one():
        for t, idx, base in last:
            shadow[t].index_copy_(0, idx, base)
        if device == "cuda":
            torch.cuda.synchronize()
        result = []
        seconds = timer.time(lambda: result.extend(encode()))
        found = sum(int(idx.numel()) for _, idx, _, _ in result)
        if found != changed:
            raise RuntimeError(f"torch encode found {found} changes, expected {changed}")
        last[:] = [(t, idx, base) for t, idx, _, base in result]
        return seconds

    samples = sample_until_done(one, policy)
    n = sum(sizes)
    return samples, n, 2.0 * n * width, f"changed={changed}"


def bench_apply(torch, state, policy, timer):
    sizes, width, share, device = state["tensor_sizes"], state["width"], state["changed_share"], state["device"]
    current, shadow, changed = make_model(torch, sizes, width, share, device, 1)
    patches = []
    for cur, sh in zip(current, shadow):
        idx = cur.ne(sh).nonzero().squeeze(1)
        patches.append((idx, cur.index_select(0, idx)))

    def apply():
        for target, (idx, vals) in zip(shadow, patches):
            target.index_copy_(0, idx, vals)

    samples = sample_until_done(lambda: timer.time(apply), policy)
    for cur, sh in zip(current, shadow):
        if not torch.equal(cur, sh):
            raise RuntimeError("torch apply did not reproduce the weights")
    k = float(changed)
    return samples, k, k * (8 + width) + k * width, f"changed={changed}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means "no torch here"
        print(f"torch_eager.py: torch is not importable: {exc}", file=sys.stderr)
        return 3
    with open(args.request) as f:
        request = json.load(f)
    torch.set_num_threads(int(request.get("threads", 1)))
    policy = request["policy"]
    rows = []
    timers = {}
    for state in request["states"]:
        row = {"id": state["id"]}
        label = f"{state['benchmark']} [{state['device']}] {sum(state['tensor_sizes'])} elements, share {state['changed_share']}"
        try:
            if state.get("error"):
                raise RuntimeError(state["error"])
            if state["device"] == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            if state["device"] not in timers:
                timers[state["device"]] = Timer(torch, state["device"])
            fn = bench_encode if state["benchmark"] == "torch_encode" else bench_apply
            samples, elements, nbytes, notes = fn(torch, state, policy, timers[state["device"]])
            row.update(samples=len(samples), median_s=statistics.median(samples), noise=relative_spread(samples),
                       elements=elements, bytes=nbytes, notes=notes)
            print(f"torch: {label}: {row['median_s'] * 1e3:.3f} ms ({len(samples)} samples)", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - reported as a skipped row, the run goes on
            row["skipped"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            print(f"torch: {label}: skipped: {row['skipped']}", file=sys.stderr)
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rows.append(row)
    with open(args.output, "w") as f:
        json.dump({"torch": f"torch {torch.__version__}, {torch.get_num_threads()} threads", "results": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
