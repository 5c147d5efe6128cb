"""Peak memory of the receiving side over model size: `deltasync pull -o DIR` of an anchor, and
a Python DeltaSubscriber loading that anchor into host tensors, each in a child process whose
peak RSS (ru_maxrss from wait4) is reported next to the model and part sizes.

  python benchmarks/pull_memory.py --bin build/bin [--model-mb 1200] [--part-mb 16] [--out FILE]

The model is random bf16 in tensors of --tensor-mb, published once (an anchor, in parts of at
most --part-mb) to a folder store. Reported: peak RSS, the binary's idle RSS (a usage error),
and (peak - idle) / part and / model; for the subscriber (tests/python/subscriber_memory_child.py)
the peak it adds over its resident weights."""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np


def write_model(path, model_bytes, tensor_bytes, seed=0):
    """A safetensors file of random bf16 tensors (names layer.K.weight), written without torch."""
    rng = np.random.default_rng(seed)
    n = max(1, model_bytes // tensor_bytes)
    rows = tensor_bytes // 2 // 1024
    header, offset = {}, 0
    for k in range(n):
        header[f"layer.{k}.weight"] = {"dtype": "BF16", "shape": [rows, 1024], "data_offsets": [offset, offset + rows * 2048]}
        offset += rows * 2048
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _ in range(n):
            f.write(rng.integers(0, 1 << 16, rows * 1024, dtype=np.uint16).tobytes())
    return offset


def peak_rss(argv, env=None):
    """(exit status, peak RSS in bytes, stderr) of argv run as a child. Through /usr/bin/time:
    the peak a child of this interpreter reports would start from the interpreter's own (fork
    copies its memory map before exec), time's fork is a few MB."""
    with tempfile.NamedTemporaryFile("r") as peak:
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", peak.name, *map(str, argv)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=env)
        return proc.returncode, int(peak.read().split()[-1]) * 1024, proc.stderr.decode(errors="replace")


CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python", "subscriber_memory_child.py")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model-mb", type=int, default=1200)
    ap.add_argument("--part-mb", type=int, default=16)
    ap.add_argument("--tensor-mb", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    exe = os.path.join(args.bin, "deltasync")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        model = os.path.join(tmp, "model.safetensors")
        size = write_model(model, args.model_mb * 10**6, args.tensor_mb * 10**6)
        store = os.path.join(tmp, "store")
        subprocess.run([exe, "publish", model, "--store", store, "--version", "1", "--anchor-part-bytes",
                        str(args.part_mb * 10**6), "--state", os.path.join(tmp, "state"), "--quiet"], check=True)
        _, idle, _ = peak_rss([exe, "pull"])  # usage error: the binary's own footprint
        rows = []
        for out in ("out_dir", "out.safetensors"):
            rc, peak, err = peak_rss([exe, "pull", "--store", store, "-o", os.path.join(tmp, out), "--quiet"])
            if rc != 0:
                sys.exit(f"pull failed: {err}")
            rows.append((f"pull -o {'DIR' if out == 'out_dir' else 'FILE'}", peak, idle))
        proc = subprocess.run([sys.executable, CHILD, store, model], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"subscriber failed: {proc.stderr}")
        sub = json.loads(proc.stdout.strip().splitlines()[-1])
        if sub["error"] or not sub["equal_to_model"]:
            sys.exit(f"subscriber failed: {sub}")
        lines = [f"model {size / 1e6:.0f} MB bf16, anchor parts <= {args.part_mb} MB, tensors {args.tensor_mb} MB",
                 "", "| path | peak RSS | idle RSS | (peak-idle)/part | (peak-idle)/model |", "|---|---|---|---|---|"]
        for name, peak, base in rows:
            extra = peak - base
            lines.append(f"| {name} | {peak / 1e6:.0f} MB | {base / 1e6:.0f} MB | {extra / (args.part_mb * 1e6):.2f} | {extra / size:.3f} |")
        extra = sub["extra"]
        lines.append(f"| DeltaSubscriber anchor (host tensors) | +{extra / 1e6:.0f} MB over the weights | - | "
                     f"{extra / (args.part_mb * 1e6):.2f} | {extra / size:.3f} |")
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n\n")


if __name__ == "__main__":
    main()
