"""Shard-local publish against gathering to rank 0, on one model, for 1, 2 and 4 trainer ranks
(torch.distributed gloo processes on this machine, a folder store).

    python benchmarks/sharded_publish.py [--layers 8] [--dim 1024] [--steps 6] [--changed 0.02] [--out FILE]

Each rank holds a Shard(0) DTensor of every weight (FSDP2's layout) and, every step, changes
about `--changed` of its elements (the same elements in both modes, chosen by a seeded generator
per rank and step). Then, per version:
  sharded  deltasync.ShardedDeltaPublisher: every rank encodes and uploads its part; the partial
           digests are summed by a reduce (int64 halves), rank 0 gathers the binary receipts and
           commits once.
  gather   the weights are gathered to rank 0 (full_tensor() over gloo), which publishes them with
           deltasync.DeltaPublisher and waits until the version is visible.
Measured per version (deltas only; anchors are reported apart): the slowest rank's publish time
(publish() call to visible), inter-rank bytes (sharded: the gathered receipts, the partials every
other rank sends into the reduce, the broadcast outcome; gather: the shard bytes every other rank
sends to rank 0) and store bytes written. And, at a 1T MoE's tensor count (69,975), how the
partials travel: a reduce of the int64 halves (16 B per tensor per rank, summed on the way) against
a gather of the 8-byte partials to rank 0 (8 B per tensor per rank, all of them into rank 0):
median seconds of 5 and the bytes."""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every rank leaves the group together and exits without Python's finalization, which can race
# gloo's run-loop threads (tests/python/rank_exit.py). Ends the workers here and in sharded_resume.py.
WORKER_LEAVE = r'''
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
'''

# The ranks' model and their optimizer "step" (benchmarks/sharded_resume.py starts from it too).
WORKER_SETUP = r'''
import json, os, sys, time, datetime
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import deltasync

mode, store, out, layers, dim, steps, changed = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]), float(sys.argv[7])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
params = {f"layers.{i}.weight": distribute_tensor(torch.randn(dim, dim).to(torch.bfloat16), mesh, [Shard(0)]) for i in range(layers)}
gen = torch.Generator().manual_seed(1000 + rank)

def step():
    for p in params.values():
        local = p.to_local().view(-1).view(torch.int16)
        n = max(1, int(local.numel() * changed))
        idx = torch.randint(0, local.numel(), (n,), generator=gen)
        local[idx] += 1

'''

WORKER = WORKER_SETUP + r'''
rows = []
if mode == "sharded":
    pub = deltasync.ShardedDeltaPublisher(params, store=store, anchor_every=0, anchor_share=0)
else:
    pub = None
    if rank == 0:
        full = {n: p.full_tensor() for n, p in params.items()}
    else:
        for p in params.values():
            p.full_tensor()
for v in range(steps):
    if v:
        step()
    dist.barrier()
    t0 = time.perf_counter()
    if mode == "sharded":
        o = pub.publish(v)
        outcome = {k: o[k] for k in ("version", "committed", "error", "fenced", "needs_tables", "anchor", "delta_bytes", "anchor_bytes",
                                     "changed_elements")}
        row = {"inter_rank_bytes": o["gathered_bytes"] + o["table_bytes"] + (o["reduce_bytes"] + len(json.dumps(outcome))) * (world - 1),
               "store_bytes": o["delta_bytes"] + o["anchor_bytes"], "anchor": o["anchor"], "receipt_bytes": o["receipt_bytes"]}
    else:
        gathered = {n: p.full_tensor() for n, p in params.items()}
        shard_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in params.values())
        row = {"inter_rank_bytes": 0, "store_bytes": 0, "anchor": v == 0}
        if rank == 0:
            for n in full:
                full[n].copy_(gathered[n])
            if pub is None:
                pub = deltasync.DeltaPublisher(full, store=store, anchor_every=0, anchor_share=0)
            s = pub.publish(v)
            pub.flush()
            s = pub.last_report
            row["store_bytes"] = s.delta_bytes + s.anchor_bytes
        # every other rank sends its shard to rank 0 (full_tensor() moves more: an all-gather)
        total = torch.tensor([shard_bytes if rank else 0], dtype=torch.int64)
        dist.all_reduce(total)
        row["inter_rank_bytes"] = int(total.item())
    row["seconds"] = time.perf_counter() - t0
    rows.append(row)
partials = {}
if mode == "sharded":
    # The partials of a 1T MoE's 69,975 tensors: reduced as int64 halves, or gathered whole.
    T = 69975
    times = {"reduce": [], "gather": []}
    for _ in range(5):
        halves = torch.ones(2 * T, dtype=torch.int64)
        dist.barrier()
        t0 = time.perf_counter()
        dist.reduce(halves, dst=0)
        times["reduce"].append(time.perf_counter() - t0)
        mine = torch.ones(T, dtype=torch.int64)
        got = [torch.empty(T, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
        dist.barrier()
        t0 = time.perf_counter()
        dist.gather(mine, got, dst=0)
        times["gather"].append(time.perf_counter() - t0)
    partials = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    partials.update(reduce_bytes_per_rank=16 * T, gather_bytes_at_rank0=8 * T * (world - 1))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rows": rows, "partials": partials}, f)
''' + WORKER_LEAVE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, world: int, args, work: Path) -> dict:
    out = work / f"{mode}-{world}"
    out.mkdir()
    script = work / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), mode, f"file://{out}/store", str(out), str(args.layers),
                                       str(args.dim), str(args.steps), str(args.changed)], env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{mode} at {world} ranks failed")
    files = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    per_rank = [f["rows"] for f in files]
    deltas = [v for v in range(args.steps) if not per_rank[0][v]["anchor"]]
    return {
        "mode": mode, "world": world,
        "seconds": statistics.median(max(per_rank[r][v]["seconds"] for r in range(world)) for v in deltas),
        "inter_rank_bytes": statistics.median(per_rank[0][v]["inter_rank_bytes"] for v in deltas),
        "receipt_bytes": max(per_rank[r][deltas[0]].get("receipt_bytes", 0) for r in range(world)),
        "store_bytes": statistics.median(per_rank[0][v]["store_bytes"] for v in deltas),
        "anchor_seconds": max(per_rank[r][0]["seconds"] for r in range(world)),
        "partials": files[0]["partials"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--changed", type=float, default=0.02)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2, 4):
            for mode in ("sharded", "gather"):
                results.append(run(mode, world, args, Path(tmp)))
                print(json.dumps(results[-1]), flush=True)
    model_mb = args.layers * args.dim * args.dim * 2 / 1e6
    lines = [f"model: {args.layers} x bf16[{args.dim}, {args.dim}] = {model_mb:.1f} MB, ~{args.changed:.0%} of elements changed per step, "
             f"{args.steps - 1} delta versions (medians); folder store; gloo processes on one machine",
             "", "| ranks | mode | publish s (slowest rank) | inter-rank bytes / version | receipt bytes / rank | store bytes / version | "
             "first anchor s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        receipt = f"{int(r['receipt_bytes']):,}" if r["mode"] == "sharded" else "-"
        lines.append(f"| {r['world']} | {r['mode']} | {r['seconds']:.3f} | {int(r['inter_rank_bytes']):,} | {receipt} | {int(r['store_bytes']):,} | "
                     f"{r['anchor_seconds']:.3f} |")
    lines += ["", "partials of 69,975 tensors (a 1T MoE): reduce of int64 halves vs gather of the 8-byte partials, median of 5",
              "", "| ranks | reduce s | bytes each rank reduces | gather s | bytes into rank 0 (gather) |", "|---|---|---|---|---|"]
    for r in results:
        p = r["partials"]
        if r["mode"] == "sharded" and p:
            lines.append(f"| {r['world']} | {p['reduce']:.4f} | {p['reduce_bytes_per_rank']:,} | {p['gather']:.4f} | {p['gather_bytes_at_rank0']:,} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
