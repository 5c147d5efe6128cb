"""Publish-to-visible and pull-and-apply latency of a 1e8-element bf16 model at ~1% change,
through the folder store and through S3 (moto on loopback, signatures checked).

  .venv/bin/python tests/python/bench_store_latency.py [--elements 100000000] [--stores file,s3]

Not a test (no assertions on time); prints one line per measurement."""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from moto_s3 import start_signed_moto  # noqa: E402
from store_model import write_safetensors  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def start_moto():
    moto = start_signed_moto("bench", user="bench")
    return moto, moto.env


def run(bin_dir, args, env):
    t0 = time.perf_counter()
    p = subprocess.run([str(bin_dir / "deltasync"), *map(str, args)], capture_output=True, text=True, env={**os.environ, **env})
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"deltasync {' '.join(map(str, args))}: {p.stderr}")
    return p.stdout.strip(), wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--bin", default=os.environ.get("DELTASYNC_BIN", REPO / "build" / "bin"))
    a = ap.parse_args()
    bin_dir = Path(a.bin)
    rng = np.random.default_rng(1)
    per = a.elements // a.tensors
    print(f"model: {a.tensors} bf16 tensors x {per} elements = {a.tensors * per * 2 / 1e6:.0f} MB; change density {a.density}")
    tensors = {}
    for t in range(a.tensors):
        f = (rng.standard_normal(per, dtype=np.float32) * 0.02)
        tensors[f"layer.{t}.weight"] = (f.view(np.uint32) >> 16).astype(np.uint16)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        v1, v2 = tmp / "v1.safetensors", tmp / "v2.safetensors"
        write_safetensors(v1, tensors)
        for arr in tensors.values():
            idx = rng.choice(per, size=int(per * a.density), replace=False)
            arr[idx] = (arr[idx].astype(np.int32) + rng.choice([-1, 1], size=idx.size)).astype(np.uint16)
        write_safetensors(v2, tensors)
        del tensors
        for kind in a.stores.split(","):
            server, env = (None, {}) if kind == "file" else start_moto()
            url = f"file://{tmp}/store-{kind}" if kind == "file" else "s3://bench/run"
            state = tmp / f"state-{kind}"
            out = tmp / f"reader-{kind}.safetensors"
            line, wall = run(bin_dir, ["publish", v1, "--store", url, "--version", 1, "--state", state, "--quiet"], env)
            print(f"[{kind}] publish v1 (anchor): command {wall:.2f} s | {line}")
            line, wall = run(bin_dir, ["pull", "--store", url, "-o", out, "--quiet"], env)
            print(f"[{kind}] pull v1 (anchor): command {wall:.2f} s | {line}")
            line, wall = run(bin_dir, ["publish", v2, "--store", url, "--version", 2, "--state", state, "--quiet"], env)
            print(f"[{kind}] publish v2 (delta): command {wall:.2f} s | {line}")
            line, wall = run(bin_dir, ["pull", "--store", url, "-o", out, "--quiet"], env)
            print(f"[{kind}] pull v2 (delta): command {wall:.2f} s | {line}")
            print(f"[{kind}] log:\n" + run(bin_dir, ["log", "--store", url], env)[0])
            if server:
                server.stop()


if __name__ == "__main__":
    main()
