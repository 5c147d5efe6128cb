"""The trainer of test_ranged_tp2.py, one rank of two (started by the sharded tests' launcher with
torch.distributed's env:// variables): every rank holds a contiguous half of every parameter of a
tiny Qwen3 as a plain per-rank tensor with its global offset and publishes each version with
deltasync.ShardedDeltaPublisher (compact deltas in small blocks, so a TP rank can read its share).
Rank 0 also saves each version as an HF checkpoint, the test's oracle.

    python sharded_trainer.py STORE_URL OUT_DIR VERSIONS
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # rank_exit
import tiny_models as tm  # noqa: E402
from test_follow_store import sparse_step  # noqa: E402
from rank_exit import leave  # noqa: E402

import deltasync  # noqa: E402


def main() -> None:
    store, out, versions = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tm.make(tm.qwen3, seed=0)
    params = dict(model.named_parameters())
    spans = {n: (p.numel() * rank // world, p.numel() * (rank + 1) // world) for n, p in params.items()}
    local = {n: params[n].detach().reshape(-1)[a:b].clone() for n, (a, b) in spans.items()}
    offsets = {n: (tuple(params[n].shape), spans[n][0]) for n in params}
    pub = deltasync.ShardedDeltaPublisher(local, store, offsets=offsets, anchor_every=0, compact_block_elements=64)
    for v in range(versions):
        if v:
            sparse_step(model, v, share=0.2)
        with torch.no_grad():
            for n, (a, b) in spans.items():
                local[n].copy_(params[n].detach().reshape(-1)[a:b])
        outcome = pub.publish(v)
        if rank == 0:
            tm.save(model, out / f"v{v}")
            print("OUTCOME", json.dumps(outcome), flush=True)
    leave()  # every rank together, and without Python's finalization (tests/python/rank_exit.py)


if __name__ == "__main__":
    main()
