"""One trainer rank of the shard-local publish tests (launched by test_sharded_publish.py with
torch.distributed's env:// variables). It trains a small bf16 model and publishes every step with
deltasync.ShardedDeltaPublisher; for the test's checks only, rank 0 also saves the gathered full
weights of every version (full_tensor() here is the test's view, never the publisher's).

    python sharded_rank.py MODE STORE_URL OUT_DIR FIRST_VERSION STEPS [KILL_AT]

MODE: fsdp2   a Sequential of Linears sharded with fully_shard, trained with AdamW
      dtensor a Shard(0), a Shard(1) and a Replicate() parameter on a 1-D mesh, AdamW
      trl     fsdp2's model published by deltasync.trl's DeltaSyncCallback (full_tensor() made to fail
              while it publishes: shard-local, never gathered)
      mismatch rank 1 claims another full shape for a plain per-rank tensor (bad input)
      fenced  fsdp2's model published as run $DS_RUN_ID (take_over when $DS_TAKE_OVER is 1); prints
              FENCE {fence} after the claim, or REFUSED <error> and stops at a refusal (the claim's
              or a version's); KILL_AT is then the version before which every rank pauses
              (creates OUT_DIR/paused-RANK, waits for OUT_DIR/resume) while another group runs
      resume  fsdp2's model, restarted: ShardedDeltaPublisher(resume=True); prints RESUMED {report}
              (resumed_version, this rank's resume_report and its shard's bytes), or REFUSED <error>
              and stops. With $DS_CHECKPOINT=1 the shards first take OUT_DIR/v{FIRST-1}.pt (the
              trainer's own checkpoint) and version FIRST is published before any training step.
      trl-resume  trl's publisher with resume=True (the same RESUMED line, from its publisher)
KILL_AT: rank 1 uploads its part of that version and is SIGKILLed before the gather.
"""
import datetime
import glob
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import deltasync
from deltasync.errors import DeltaSyncError
from deltasync.sharded import ShardedPublishError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rank_exit import leave  # noqa: E402


def fsdp2_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # 13 rows over 2 or 4 ranks: uneven shards, and an empty one at 4 ranks for the 3-row bias.
    model = torch.nn.Sequential(torch.nn.Linear(24, 13), torch.nn.GELU(), torch.nn.Linear(13, 3)).to(torch.bfloat16)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dtensor_model(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    full = {"rows.weight": torch.randn(10, 6), "cols.weight": torch.randn(5, 9), "shared.bias": torch.randn(7)}
    placements = {"rows.weight": Shard(0), "cols.weight": Shard(1), "shared.bias": Replicate()}
    params = torch.nn.ParameterDict({
        name.replace(".", "_"): torch.nn.Parameter(distribute_tensor(t.to(torch.bfloat16), mesh, [placements[name]]))
        for name, t in full.items()})
    return params


class CallbackPublisher:
    """deltasync.trl's callback driven as transformers' Trainer drives it, one step per version."""

    def __init__(self, model, store, **options):
        from types import SimpleNamespace

        from torch.distributed.tensor import DTensor

        from deltasync.trl import DeltaSyncCallback

        self.model, self.ns, self.dtensor = model, SimpleNamespace, DTensor
        self.callback = DeltaSyncCallback(store, anchor_every=4, anchor_share=0, **options)

    def publish(self, version):
        state = self.ns(global_step=version, is_world_process_zero=dist.get_rank() == 0)
        real = self.dtensor.full_tensor

        def refuse(*a, **k):
            raise AssertionError("full_tensor() called while publishing")

        self.dtensor.full_tensor = refuse
        try:
            self.callback.on_step_end(self.ns(use_vllm=False), state, None, model=self.model)
        finally:
            self.dtensor.full_tensor = real
        report = self.callback.reports[-1]
        return {"committed": report.visible, "anchor": report.anchor, "changed_elements": report.changed_elements,
                "delta_bytes": report.delta_bytes, "gathered_bytes": 0}


def load_checkpoint(model, path):
    """The trainer's own restart: every rank's shards from the gathered weights saved at `path`."""
    from torch.distributed.tensor import distribute_tensor

    full = torch.load(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(distribute_tensor(full[name], p.device_mesh, p.placements).to_local())


def shard_bytes(model):
    """What this rank's anchor slices would hold: its local elements."""
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def print_resumed(pub, model):
    print("RESUMED", json.dumps({"resumed_version": pub.resumed_version, "shard_bytes": shard_bytes(model), **pub.resume_report}),
          flush=True)


def main():
    mode, store, out_dir, first, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    kill_at = int(sys.argv[6]) if len(sys.argv) > 6 else None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    if mode in ("mismatch", "overlap", "missing"):
        # Plain per-rank tensors with offsets (no rule: each rank's placement travels in its
        # receipt). mismatch: rank 1 says another shape (its table's hash differs: rank 0 gathers
        # the tables); overlap: rank 1's elements start inside rank 0's; missing: rank 1's anchor
        # part is gone from the store before rank 0 commits.
        local = torch.zeros(16, dtype=torch.bfloat16)
        shape = [8, 5] if mode == "mismatch" and rank == 1 else [8, 4]
        offset = 8 if mode == "overlap" and rank == 1 else 16 * rank
        pub = deltasync.ShardedDeltaPublisher({"w": local}, store=store, offsets={"w": (shape, offset)})
        if mode == "missing" and rank == 1:
            real = pub._native

            class LosesItsPart:
                def __getattr__(self, name):
                    return getattr(real, name)

                def publish_part(self, version, local, anchor):
                    receipt = real.publish_part(version, local, anchor)
                    root = store[len("file://"):]
                    for part in glob.glob(os.path.join(root, "anchors", f"{version:020d}-*", "part-00001.safetensors")):
                        os.remove(part)
                    return receipt

            pub._native = LosesItsPart()
        try:
            outcome = pub.publish(first)
            print("PUBLISHED", json.dumps(outcome), flush=True)
        except ShardedPublishError as e:
            print("REFUSED", e, flush=True)
            print("OUTCOME", json.dumps(pub.last_outcome), flush=True)
        leave()
        return

    model = dtensor_model(mesh) if mode == "dtensor" else fsdp2_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "trl":
        pub = CallbackPublisher(model, store)
    elif mode in ("resume", "trl-resume"):
        if os.environ.get("DS_CHECKPOINT") == "1":
            load_checkpoint(model, os.path.join(out_dir, f"v{first - 1}.pt"))
        try:
            if mode == "resume":
                pub = deltasync.ShardedDeltaPublisher(model, store=store, anchor_every=8, anchor_share=0, resume=True)
                print_resumed(pub, model)
            else:  # the callback builds its publisher, and resumes, at its first step
                pub = CallbackPublisher(model, store, resume=True)
        except DeltaSyncError as e:
            print("REFUSED", type(e).__name__, e, flush=True)
            leave()
            return
    elif mode == "fenced":
        try:
            pub = deltasync.ShardedDeltaPublisher(model, store=store, anchor_every=4, anchor_share=0,
                                                  run_id=os.environ["DS_RUN_ID"],
                                                  take_over=os.environ.get("DS_TAKE_OVER") == "1")
        except DeltaSyncError as e:
            print("REFUSED", type(e).__name__, e, flush=True)
            leave()
            return
        print("FENCE", json.dumps(pub.fence), flush=True)
    else:
        pub = deltasync.ShardedDeltaPublisher(model, store=store, anchor_every=4, anchor_share=0)
    if kill_at is not None and rank == 1 and mode != "fenced":
        real = pub._native

        class DiesAfterUpload:  # the part reaches the store, the receipt never reaches rank 0
            def __getattr__(self, name):
                return getattr(real, name)

            def publish_part(self, version, local, anchor):
                receipt = real.publish_part(version, local, anchor)
                if version == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return receipt

        pub._native = DiesAfterUpload()

    gen = torch.Generator().manual_seed(1234)  # the same batches on every rank
    for version in range(first, first + steps):
        if version > first:
            x = torch.randn(8, 24, generator=gen).to(torch.bfloat16)
            if mode != "dtensor":
                loss = model(x).float().square().mean()
            else:
                w = {k: p for k, p in model.items()}
                loss = ((w["rows_weight"].sum() * w["cols_weight"]).square().mean() + w["shared_bias"].square().sum()).float()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if mode == "fenced" and version == kill_at:
            open(os.path.join(out_dir, f"paused-{rank}"), "w").close()
            while not os.path.exists(os.path.join(out_dir, "resume")):
                time.sleep(0.1)
        try:
            outcome = pub.publish(version)
        except ShardedPublishError as e:
            if mode != "fenced":
                raise
            print("REFUSED", type(e).__name__, e, flush=True)
            break
        # The test's view of the weights (gathered for checking only).
        with torch.no_grad():
            full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, os.path.join(out_dir, f"v{version}.pt"))
            with open(os.path.join(out_dir, f"v{version}.json"), "w") as f:
                json.dump(outcome, f)
        if mode == "trl-resume" and version == first:
            print_resumed(pub.callback.sync.publisher, model)
        print("VERSION", version, json.dumps(outcome), flush=True)
    leave()


if __name__ == "__main__":
    main()
