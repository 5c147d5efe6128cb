"""Peak memory of the receiving side over model size: `deltasync pull -o DIR` of an anchor, of
deltas onto it and of an anchor plus deltas, and a Python DeltaSubscriber loading that anchor
into host tensors; then the same model as a shard-local anchor of slices (one part per rank,
--part-mb each) pulled and loaded. Each in a child process whose peak RSS is reported next to
the model and part sizes.

  python benchmarks/pull_memory.py --bin build/bin [--before-bin OTHER/bin] [--model-mb 1200] [--part-mb 16] [--out FILE]

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


def mutate_model(src, dst, fraction, seed):
    """dst := src with `fraction` of its elements (spread over every tensor) set to new bits: the
    next step of a trainer, for a delta."""
    rng = np.random.default_rng(seed)
    with open(src, "rb") as f:
        data = bytearray(f.read())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    body = np.frombuffer(data, dtype=np.uint16, offset=start)
    body = body.copy()
    where = rng.choice(body.size, max(1, int(body.size * fraction)), replace=False)
    body[where] ^= rng.integers(1, 1 << 16, where.size, dtype=np.uint16)
    with open(dst, "wb") as f:
        f.write(data[:start])
        f.write(body.tobytes())


def publish_sliced(model, store, ranks, version=1):
    """Publishes `model` as a shard-local anchor of `ranks` parts, one per rank, each holding a
    contiguous slice of every tensor (ShardPublisher's plain per-rank tensors with an offset):
    the ranks run one after the other in this process, their receipts committed by rank 0 as a
    gloo group's rank 0 would."""
    from safetensors import safe_open

    from deltasync._library import native

    url = "file://" + os.path.abspath(store)
    with safe_open(model, "pt") as st:
        names = list(st.keys())
        full = {n: st.get_tensor(n) for n in names}
    claim = native().claim_for_group(url, {})
    ranks_out = []
    for r in range(ranks):
        specs, local = [], []
        for n in names:
            flat = full[n].reshape(-1)
            lo, hi = r * flat.numel() // ranks, (r + 1) * flat.numel() // ranks
            specs.append(("offset", list(full[n].shape), lo, 0, 0))
            local.append(flat[lo:hi].clone())
        ranks_out.append((native().ShardPublisher(url, names, local, specs, r, claim, {}, None), local))
    parts = [pub.publish_part(version, local, True) for pub, local in ranks_out]  # (receipt, partial halves)
    receipts = [receipt for receipt, _ in parts]
    summed = sum(halves for _, halves in parts)  # what the group's reduce would give rank 0
    outcome = ranks_out[0][0].commit(receipts, summed)
    for pub, _ in ranks_out:
        pub.conclude(outcome)
    if not json.loads(outcome)["committed"]:
        raise RuntimeError(f"sharded publish failed: {outcome}")


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
    ap.add_argument("--before-bin", help="a build to compare with (its pull rows are marked [before])")
    args = ap.parse_args()
    exe = os.path.join(args.bin, "deltasync")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        model = os.path.join(tmp, "model.safetensors")
        size = write_model(model, args.model_mb * 10**6, args.tensor_mb * 10**6)
        store = os.path.join(tmp, "store")
        subprocess.run([exe, "publish", model, "--store", store, "--version", "1", "--anchor-part-bytes",
                        str(args.part_mb * 10**6), "--state", os.path.join(tmp, "state"), "--quiet"], check=True)
        _, idle, _ = peak_rss([exe, "pull"])  # usage error: the binary's own footprint
        before = os.path.join(args.before_bin, "deltasync") if args.before_bin else None
        before_idle = peak_rss([before, "pull"])[1] if before else None
        rows = []

        def pull(label, store, out, *extra):
            # The binary measured, and (--before-bin) the one it is compared with, each into its own OUT.
            for name, binary, base in ((label, exe, idle), *([(label + " [before]", before, before_idle)] if before else [])):
                rc, peak, err = peak_rss([binary, "pull", "--store", store, "-o", os.path.join(tmp, out + ("_before" if binary == before else "")),
                                          "--quiet", *extra])
                if rc != 0:
                    sys.exit(f"pull failed: {err}")
                rows.append((name, peak, base))

        def subscriber(label, store):
            proc = subprocess.run([sys.executable, CHILD, store, model], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"subscriber failed: {proc.stderr}")
            sub = json.loads(proc.stdout.strip().splitlines()[-1])
            if sub["error"] or not sub["equal_to_model"]:
                sys.exit(f"subscriber failed: {sub}")
            rows.append((label, sub["extra"], None))

        pull("pull -o DIR (anchor)", store, "out_dir")
        pull("pull -o FILE (anchor)", store, "out.safetensors")
        subscriber("DeltaSubscriber anchor (host tensors)", store)
        # Versions 2 and 3: deltas changing 1% of the elements.
        state = os.path.join(tmp, "state")
        previous = model
        for v in (2, 3):
            nxt = os.path.join(tmp, f"model-{v}.safetensors")
            mutate_model(previous, nxt, 0.01, seed=v)
            subprocess.run([exe, "publish", nxt, "--store", store, "--version", str(v), "--state", state, "--quiet"], check=True)
            if previous != model:
                os.remove(previous)
            previous = nxt
        pull("pull -o DIR (deltas 2, 3 onto OUT at 1)", store, "out_dir")
        pull("pull -o FILE (deltas 2, 3 onto OUT at 1)", store, "out.safetensors")
        pull("pull -o DIR (anchor 1 + deltas 2, 3, fresh OUT)", store, "fresh_dir")
        # The same model as a shard-local anchor of one part per rank.
        sliced = os.path.join(tmp, "sliced")
        ranks = max(1, size // (args.part_mb * 10**6))
        publish_sliced(model, sliced, ranks)
        pull(f"pull -o DIR (slice anchor, {ranks} ranks)", sliced, "sliced_dir")
        subscriber(f"DeltaSubscriber slice anchor ({ranks} ranks, host tensors)", sliced)
        lines = [f"model {size / 1e6:.0f} MB bf16, anchor parts <= {args.part_mb} MB, tensors {args.tensor_mb} MB",
                 "", "| path | peak RSS | idle RSS | (peak-idle)/part | (peak-idle)/model |", "|---|---|---|---|---|"]
        for name, peak, base in rows:
            if base is None:  # a subscriber: what the update added over its resident weights
                lines.append(f"| {name} | +{peak / 1e6:.0f} MB over the weights | - | {peak / (args.part_mb * 1e6):.2f} | {peak / size:.3f} |")
                continue
            extra = peak - base
            lines.append(f"| {name} | {peak / 1e6:.0f} MB | {base / 1e6:.0f} MB | {extra / (args.part_mb * 1e6):.2f} | {extra / size:.3f} |")
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n\n")


if __name__ == "__main__":
    main()
