"""One vLLM worker's subscriber, which both the native weight-transfer backend (backend.py) and
the collective_rpc worker extension (extension.py) drive:

    sub = WorkerSubscriber(model, checkpoint=vllm_config.model_config.model, group=tp_cpu_group, rank=tp_rank)
    sub.connect(store)         # refuse, check the served weights, learn the maps: nothing written
    sub.update(version=None)   # anchor and/or deltas in place, newest by default

connect() decides, before anything is written, whether the model can be updated in place
(updatable.py) and learns the index maps on twins (index_map.py); every update then runs in the
C++ mapped receiver (receiver.py -> host/sync/mapped_receiver.hpp): fetched, verified per rank and
summed over the tensor-parallel group, mapped, applied in place, rolled back on every rank on a
failure.
"""
from __future__ import annotations

import time
from dataclasses import asdict

import torch

from .._dtypes import TORCH_DTYPE
from .._library import native
from ..subscriber import DeltaSubscriber, UpdateReport
from .index_map import IndexMap, learn_index_maps
from .receiver import mapped_subscriber
from .updatable import check_served_weights, checkpoint_files, refuse_if_not_updatable


def tensor_parallel_group():
    """(vLLM's tensor-parallel CPU group, this rank) when there is more than one rank, else
    (None, 0). The CPU group is gloo: the digest partials and the agreed version are a few
    integers."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
    except ImportError:
        return None, 0
    try:
        if get_tensor_model_parallel_world_size() > 1:
            return get_tp_group().cpu_group, get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):  # no parallel state initialized (a bare model)
        pass
    return None, 0


def published_tensors(store: str, version: int | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Names, dtypes and shapes of the published tensors, from the headers of the anchor the
    catch-up to `version` (default: the newest) starts from."""
    return {name: (TORCH_DTYPE[dtype], tuple(shape)) for name, dtype, shape in native().published_tensors(store, version)}


def report_dict(r: UpdateReport, stages: dict | None = None) -> dict:
    """An update's report: the UpdateReport's fields under their own names (to_version,
    bytes_fetched, total_seconds, ...), and `stages`: the mapped receiver's seconds per stage
    (map_seconds: HF -> runtime positions, scatter_seconds: the writes, and parse/gather/pack/digest,
    anchor_*)."""
    return {**asdict(r), **(stages or {})}


# Set on the model once deltasync began writing into its weights (kept across subscribers).
_WROTE = "_deltasync_wrote"


class WorkerSubscriber:
    def __init__(self, model: torch.nn.Module, checkpoint: str | None = None, group=None, rank: int = 0):
        self.model = model
        # What the engine was started from, checked against the served weights only while they
        # are still those: once deltasync wrote into them (a version, verified by its digests, or
        # part of an anchor that failed) they differ, and the layout the check guards was
        # accepted by the first connect.
        self.checkpoint = None if getattr(model, _WROTE, False) else checkpoint
        self.group, self.rank = group, rank
        self.subscriber: DeltaSubscriber | None = None
        self.index_map: IndexMap | None = None
        self.connect_report: dict = {}
        self.mapped = None  # the C++ mapped subscriber (its stage timings)
        # Why the weights are torn: an anchor failed after its first write (the receiver is at no
        # version until a later anchor is written whole). None: they hold a version, or the
        # engine's start checkpoint.
        self.broken: str | None = None

    def connect(self, store: str, version: int | None = None) -> dict:
        """Refuses a model that cannot be updated in place, or learns the index maps for the
        tensors of the anchor the catch-up to `version` starts from. Writes nothing."""
        started = time.perf_counter()
        refuse_if_not_updatable(self.model)
        files = checkpoint_files(self.checkpoint)
        compared = check_served_weights(self.model, files) if files else 0
        checked = time.perf_counter()
        imap = learn_index_maps(self.model, published_tensors(store, version))
        learned = time.perf_counter()
        native_sub = mapped_subscriber(store, imap, group=self.group, rank=self.rank)
        self.subscriber = DeltaSubscriber(None, store=store, _native=native_sub)
        self.mapped = native_sub
        self.index_map = imap
        self.connect_report = {"check_seconds": checked - started, "learn_seconds": learned - checked,
                               "connect_seconds": time.perf_counter() - started, "served_weights_checked": compared,
                               "index_map": imap.describe(), "index_map_bytes": imap.bytes(),
                               "map_runs": native_sub.map_runs}
        return dict(self.connect_report)

    def start(self, store: str, version: int | None = None) -> dict:
        """connect(), then the weights to `version` (default: the newest)."""
        started = time.perf_counter()
        self.connect(store, version)
        report = self.update(version)
        report.update(self.connect_report, init_seconds=time.perf_counter() - started)
        return report

    def update(self, version: int | None = None) -> dict:
        """The weights to `version` in place (default: the newest, as rank 0 sees it: every rank
        goes to the same version even when a publish lands between their polls)."""
        sub = self._require()
        target = int(version) if version is not None else self._agreed_newest()
        if target is None:
            raise RuntimeError(f"deltasync.vllm: {sub.store}: the store has no published versions")
        self.mapped.take_timings()  # seconds of this update only
        setattr(self.model, _WROTE, True)
        try:
            sub.update(target)
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}" if self.mapped.torn else None
            raise
        finally:
            stages = self.mapped.take_timings()
        self.broken = None
        return report_dict(sub.last_report, stages)

    def poll(self) -> int | None:
        return self._require().poll()

    @property
    def version(self) -> int | None:
        return self._require().version

    def _agreed_newest(self) -> int | None:
        sub = self._require()
        if self.group is None:
            return sub.poll()
        newest = sub.poll() if self.rank == 0 else None
        # A sum over the group in which only rank 0 contributes (-1: nothing published).
        t = torch.tensor([(-1 if newest is None else newest) if self.rank == 0 else 0], dtype=torch.int64)
        self.group.allreduce([t]).wait()
        return None if int(t) < 0 else int(t)

    def _require(self) -> DeltaSubscriber:
        if self.subscriber is None:
            raise RuntimeError("deltasync.vllm: not set up: call deltasync_init(store) / init_weight_transfer_engine first")
        return self.subscriber
