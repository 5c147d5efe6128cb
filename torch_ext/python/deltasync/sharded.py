"""Shard-local publish: a sharded trainer (FSDP2 `fully_shard`, DTensor `Shard(d)` /
`Replicate()` on a 1-D mesh, or plain per-rank tensors with a global offset) publishes without
gathering. Every rank encodes its own shard against its own shadow and uploads its part; rank 0
gathers the small receipts (a few hundred bytes each: hashes of the rank's tensor table and
placement rules, its object references) and the partial digests summed by a reduce
(torch.distributed, the default or given group), the C++ core derives every rank's placements
from the rules, checks that the parts tile every tensor and commits the version once; the outcome
is broadcast, so every rank knows whether the version became visible. Only when a rank's table or
rules differ from rank 0's does rank 0 gather every rank's whole table, to name the rank and tensor
(or to commit placements no rule gives). Readers see an ordinary store: a version published
by 8 ranks reads exactly like one published by 1 (host/sync/shard_publish.hpp, shard_parts.hpp).

    model = fully_shard(model)                       # on every rank
    pub = deltasync.ShardedDeltaPublisher(model, store="file:///bucket")
    for step in ...:
        optimizer.step()
        pub.publish(step)                            # every rank, same version

Construct and publish on every rank of the group, like a collective. Python only reads where the
shards sit (placements, device_mesh, to_local(); never full_tensor()) and runs the reduce, the
gathers and the broadcast; the C++ core does the rest.

Fencing is DeltaPublisher's: rank 0 claims the store once at construction (run_id=, take_over=),
the outcome is broadcast, and a refusal is raised on every rank before anything is written.

resume=True: a restarted group of the same run continues the store instead of publishing the
model again. Every rank recovers the shadow of its own shard at the version the new epoch starts
from (`resumed_version`), reading only the parts and byte ranges that overlap its placements (in
full-tensor coordinates: another world size than the publishing group's works alike); the ranks'
partial digests are summed and checked against the manifest. The next version is a delta. The
trainer's own weights are not touched (they may differ from the store's: the delta carries it).
"""
from __future__ import annotations

import json
from typing import Mapping

import torch
import torch.distributed as dist

from ._library import native
from ._params import named_tensors
from .errors import DeltaSyncError, InvalidArgumentError


class ShardedPublishError(DeltaSyncError):
    """A version did not become visible (a rank failed, or the commit refused the parts); raised on
    every rank. The next version is published as an anchor."""


class ShardedFencedError(ShardedPublishError, InvalidArgumentError):
    """The group's fence no longer holds the store (another run, or a newer epoch of this run,
    claimed it): raised on every rank, and nothing this group publishes from then on becomes
    visible (docs/stores.md, Fencing)."""


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        from torch.distributed._tensor import DTensor
    return DTensor


def _spec(name: str, t: torch.Tensor, offsets: Mapping, rank: int) -> tuple[tuple, torch.Tensor]:
    """(placement spec for the C++ side, local tensor) of one parameter."""
    DTensor = _dtensor_type()
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    if isinstance(data, DTensor):
        from torch.distributed.tensor import Replicate, Shard

        mesh = data.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"deltasync.ShardedDeltaPublisher: tensor {name} is on a {mesh.ndim}-D device mesh; "
                             "shard-local publish takes 1-D meshes (FSDP2, or TP on one dimension)")
        (placement,) = data.placements
        coordinate = mesh.get_local_rank()
        full_shape = [int(d) for d in data.shape]
        local = data.to_local()
        if isinstance(placement, Shard):
            return ("shard", full_shape, int(placement.dim) % len(full_shape), int(coordinate), int(mesh.size())), local
        if isinstance(placement, Replicate):
            return ("replicate", full_shape, int(coordinate), 0, 0), local
        raise ValueError(f"deltasync.ShardedDeltaPublisher: tensor {name} has placement {placement}; "
                         "shard-local publish takes Shard(d) and Replicate()")
    if name in offsets:
        full_shape, offset = offsets[name]
        return ("offset", [int(d) for d in full_shape], int(offset), 0, 0), data
    # A plain tensor every rank holds whole (DDP-style): published by the group's first rank.
    return ("replicate", [int(d) for d in data.shape], rank, 0, 0), data


class ShardedDeltaPublisher:
    def __init__(self, model, store, *, process_group=None, offsets: Mapping | None = None, log=None, resume: bool = False,
                 **options):
        """`model`: a module (its parameters), a dict or (name, tensor) pairs, the same names on
        every rank. `offsets`: {name: (full_shape, flat_offset)} for plain per-rank tensors that
        hold a contiguous piece of a larger tensor. `process_group`: the trainer ranks (default:
        the default group). The keywords are DeltaPublisher's (anchor_every, anchor_share,
        format, keep_anchors, run_id, take_over, ...). Rank 0 claims the store for run_id with a
        new epoch; a store held by another run (without take_over) raises InvalidArgumentError
        with the same one line on every rank, nothing written. resume=True: see the module's
        docstring; a rank whose recovery fails makes every rank raise the same one line
        (DeltaSyncError), nothing written. `resume_report`: this rank's bytes read and seconds."""
        if not dist.is_initialized():
            raise RuntimeError("deltasync.ShardedDeltaPublisher: torch.distributed is not initialized")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self._root = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        self._offsets = dict(offsets or {})
        named = named_tensors(model)
        self.names = [n for n, _ in named]
        self._params = [t for _, t in named]
        specs, local = self._locals()
        self.store = str(store)
        options = dict(options)
        claim = [native().claim_for_group(self.store, options) if self.rank == 0 else None]
        dist.broadcast_object_list(claim, src=self._root, group=self.group)
        self._native = native().ShardPublisher(self.store, self.names, local, specs, self.rank, claim[0], options, log)
        self.last_outcome: dict | None = None
        self.outcomes: list[dict] = []
        self.resumed_version: int | None = None
        self.resume_report: dict | None = None
        if resume:
            receipt, halves = self._native.recover()
            halves = halves.to(self._collective_device())
            dist.all_reduce(halves, group=self.group)
            receipts = [None] * self.world
            dist.all_gather_object(receipts, receipt, group=self.group)
            tables = None
            if self._native.tables_needed(receipts):
                tables = [None] * self.world
                dist.all_gather_object(tables, self._native.table(), group=self.group)
            self.resumed_version = self._native.adopt(receipts, halves, tables)
            self.resume_report = self._native.resume_report()

    def _collective_device(self) -> torch.device:
        """Where the reduced partials live: NCCL reduces CUDA tensors only."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _locals(self):
        pairs = [_spec(n, t, self._offsets, self.rank) for n, t in zip(self.names, self._params)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    @torch.no_grad()
    def publish(self, version: int, anchor: bool | None = None) -> dict:
        """Every rank, the same version: encodes and uploads this rank's part, then the group
        commits it once. Returns the outcome (committed, anchor, delta_bytes, anchor_bytes,
        changed_elements, and this rank's inter-rank bytes: receipt_bytes, reduce_bytes, and at
        rank 0 gathered_bytes, table_bytes when the tables were gathered); raises
        ShardedPublishError on every rank when the version did not become visible,
        ShardedFencedError when because the group was fenced off (and from then on at every
        publish)."""
        version = int(version)
        want_anchor = self._native.anchor_due(version) if anchor is None else bool(anchor)
        try:
            receipt, halves = self._native.publish_part(version, self._locals()[1], want_anchor)
        except Exception as e:  # noqa: BLE001 -- reported to rank 0 so that nothing is committed
            receipt, halves = self._native.failed_receipt(version, f"{type(e).__name__}: {e}")
        # The partials add mod 2^64: summed as 32-bit halves in int64 (no signed overflow).
        halves = halves.to(self._collective_device())
        dist.reduce(halves, dst=self._root, op=dist.ReduceOp.SUM, group=self.group)
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(receipt, gathered, dst=self._root, group=self.group)
        box = [self._native.commit(gathered, halves) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self._root, group=self.group)
        tables = None
        if json.loads(box[0])["needs_tables"]:  # a rank's table or rules differ: rank 0 reads them all
            tables = [None] * self.world if self.rank == 0 else None
            dist.gather_object(self._native.table(), tables, dst=self._root, group=self.group)
            box = [self._native.commit(gathered, halves, tables) if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=self._root, group=self.group)
        self._native.conclude(box[0])
        outcome = json.loads(box[0])
        outcome["receipt_bytes"] = len(receipt)
        outcome["reduce_bytes"] = halves.numel() * halves.element_size()
        outcome["gathered_bytes"] = sum(len(r) for r in gathered) if gathered else 0
        outcome["table_bytes"] = sum(len(t) for t in tables) if tables else 0
        self.last_outcome = outcome
        self.outcomes.append(outcome)
        if not outcome["committed"]:
            raise (ShardedFencedError if outcome["fenced"] else ShardedPublishError)(outcome["error"])
        return outcome

    def state(self) -> dict:
        """What the store shows, as every rank knows it: last_version, last_anchor_version, ..."""
        return self._native.state()

    @property
    def fence(self) -> dict:
        """The run and epoch the group claimed the store with: run_id, epoch, since (the version
        the epoch started from; None for an empty store). The same on every rank."""
        return self._native.fence

    def placements(self) -> list[tuple[str, list[int]]]:
        """(name, [first, run_length, run_stride, run_count]) of what this rank publishes."""
        return self._native.placements()
