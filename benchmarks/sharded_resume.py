"""A restarted sharded trainer group resumes from the store (ShardedDeltaPublisher(resume=True))
instead of publishing the model again: per rank, what the recovery reads and how long it takes,
against the anchor slices that rank would otherwise upload (torch.distributed gloo processes on
this machine, a folder store).

    python benchmarks/sharded_resume.py [--layers 8] [--dim 1024] [--versions 4] [--changed 0.02] [--out FILE]

For each (ranks before, ranks after): a group of `before` ranks (Shard(0) DTensors, FSDP2's
layout) publishes an anchor and `versions - 1` deltas (about `--changed` of the elements each) and
exits; a group of `after` ranks then starts with resume=True from the initial weights (not the
store's: its first version, after one more step, carries the changes of every step) and publishes it. Reported per rank of the restarted group (max over ranks): resume
seconds and bytes read (resume_report), the anchor bytes its shard would be, the first version's
upload (a delta) and, for comparison, the first group's anchor publish seconds (the slowest rank)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sharded_publish import WORKER_LEAVE, WORKER_SETUP, free_port

# mode: publish (the first group) or resume (the restarted one); steps: the first group's versions.
WORKER = WORKER_SETUP + r'''
row = {"rank": rank, "shard_bytes": sum(p.to_local().numel() * p.to_local().element_size() for p in params.values())}
dist.barrier()
t0 = time.perf_counter()
pub = deltasync.ShardedDeltaPublisher(params, store=store, anchor_every=0, anchor_share=0, resume=mode == "resume")
row["construct_seconds"] = time.perf_counter() - t0
if mode == "resume":
    row.update(pub.resume_report, resumed_version=pub.resumed_version)
    first, count = pub.resumed_version + 1, 1
else:
    first, count = 0, steps
for v in range(first, first + count):
    if v:
        step()
    dist.barrier()
    t0 = time.perf_counter()
    o = pub.publish(v)
    row.setdefault("publish", []).append({"version": v, "seconds": time.perf_counter() - t0, "anchor": o["anchor"],
                                          "delta_bytes": o["delta_bytes"], "anchor_bytes": o["anchor_bytes"]})
with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
    json.dump(row, f)
''' + WORKER_LEAVE


def launch(phase: str, world: int, store: str, out: Path, args, script: Path) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), phase, store, str(out), str(args.layers), str(args.dim),
                                       str(args.versions), str(args.changed)], env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{phase} at {world} ranks failed")
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(world)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--changed", type=float, default=0.02)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        for before, after in ((2, 2), (4, 4), (4, 2), (2, 4)):
            out = Path(tmp) / f"{before}-{after}"
            out.mkdir()
            store = f"file://{out}/store"
            first = launch("publish", before, store, out, args, script)
            again = launch("resume", after, store, out, args, script)
            row = {"before": before, "after": after,
                   "first_anchor_seconds": max(r["publish"][0]["seconds"] for r in first),
                   "resume_seconds": max(r["seconds"] for r in again),
                   "bytes_read": max(r["bytes_read"] for r in again),
                   "shard_anchor_bytes": max(r["shard_bytes"] for r in again),
                   "whole_objects": max(r["whole_objects"] for r in again),
                   "ranged_reads": max(r["ranged_reads"] for r in again),
                   "next_anchor": again[0]["publish"][0]["anchor"],
                   "next_delta_bytes": again[0]["publish"][0]["delta_bytes"],
                   "next_publish_seconds": max(r["publish"][0]["seconds"] for r in again)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    model_mb = args.layers * args.dim * args.dim * 2 / 1e6
    lines = [f"model: {args.layers} x bf16[{args.dim}, {args.dim}] = {model_mb:.1f} MB; {args.versions} versions (an anchor, then deltas of "
             f"~{args.changed:.0%} of the elements) by the first group; folder store; gloo processes on one machine; max over ranks",
             "", "| ranks before -> after | resume s / rank | bytes read / rank | its anchor slices (bytes) | read / anchor | "
             "whole parts, ranged reads | next version | its delta bytes (all ranks) | next publish s | first group's anchor s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['before']} -> {r['after']} | {r['resume_seconds']:.3f} | {r['bytes_read']:,} | {r['shard_anchor_bytes']:,} | "
                     f"{r['bytes_read'] / r['shard_anchor_bytes']:.2f} | {r['whole_objects']}, {r['ranged_reads']} | "
                     f"{'anchor' if r['next_anchor'] else 'delta'} | {r['next_delta_bytes']:,} | {r['next_publish_seconds']:.3f} | "
                     f"{r['first_anchor_seconds']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
