"""DeltaWorkerExtension: methods vLLM mixes into every worker (--worker-extension-cls) and that
the engine calls with collective_rpc:

    deltasync_init(store, version=None)  learn the HF -> runtime index maps through the model's
                                         own loaders, load the anchor the catch-up starts from
                                         via load_weights (audited: the runtime parameters must
                                         hash to the anchor's digests), then apply deltas up to
                                         `version`; returns a report
    deltasync_update(version=None)       apply deltas in place up to `version` (default newest);
                                         returns {version, bytes, seconds, pause_seconds, ...}
    deltasync_poll()                     newest visible version in the store
    deltasync_version()                  version the weights are at

Each delta is applied by the C++ mapped receiver: positions mapped through the learned runs,
one gather of the bits it replaces, one scatter, digests verified per rank over the elements it
owns and summed across the tensor-parallel group; a mismatch rolls back on every rank. No CPU
snapshot of the weights, no full-tensor rebuild: memory is O(changed) plus the index maps (runs).
"""
from __future__ import annotations

import time

import torch

from .._dtypes import TORCH_DTYPE
from .._library import native
from ..subscriber import DeltaSubscriber
from .index_map import learn_index_maps
from .receiver import mapped_subscriber


def published_tensors(store: str, version: int | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Names, dtypes and shapes of the published tensors, from the anchor headers."""
    return {name: (TORCH_DTYPE[dtype], tuple(shape)) for name, dtype, shape in native().published_tensors(store, version)}


class DeltaWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _deltasync_model(self) -> torch.nn.Module:
        runner = getattr(self, "model_runner", None)
        # get_model() unwraps what recent vLLM wraps around the model (CUDA-graph wrappers).
        model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
        if model is None:
            raise RuntimeError("deltasync.vllm: cannot find the worker's model (model_runner.model)")
        return model

    def _deltasync_group(self):
        """(process group, rank) over which digest partials are summed: vLLM's tensor-parallel
        CPU group when there is more than one rank, else (None, 0)."""
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

    def deltasync_init(self, store: str, version: int | None = None) -> dict:
        started = time.perf_counter()
        model = self._deltasync_model()
        hf = published_tensors(store, version)
        t0 = time.perf_counter()
        imap = learn_index_maps(model, hf)
        learn_seconds = time.perf_counter() - t0
        group, rank = self._deltasync_group()
        native_sub = mapped_subscriber(store, imap, model.load_weights, group=group, rank=rank)
        sub = DeltaSubscriber(None, store=store, _native=native_sub)
        sub.update(version)
        self._deltasync = sub
        self._deltasync_imap = imap
        report = self._deltasync_report(sub)
        report.update(init_seconds=time.perf_counter() - started, learn_seconds=learn_seconds,
                      index_map=imap.describe(), index_map_bytes=imap.bytes())
        return report

    def deltasync_update(self, version: int | None = None) -> dict:
        sub = self._deltasync_subscriber()
        sub.update(version)
        return self._deltasync_report(sub)

    def deltasync_poll(self) -> int | None:
        return self._deltasync_subscriber().poll()

    def deltasync_version(self) -> int | None:
        return self._deltasync_subscriber().version

    def _deltasync_subscriber(self) -> DeltaSubscriber:
        sub = getattr(self, "_deltasync", None)
        if sub is None:
            raise RuntimeError("deltasync.vllm: call deltasync_init(store) first")
        return sub

    @staticmethod
    def _deltasync_report(sub: DeltaSubscriber) -> dict:
        r = sub.last_report
        return {"version": r.to_version, "from_version": r.from_version, "anchor": r.anchor, "deltas": r.deltas,
                "changed_elements": r.changed_elements, "applied_elements": r.applied_elements,
                "bytes": r.bytes_fetched, "seconds": r.total_seconds, "fetch_seconds": r.fetch_seconds,
                "pause_seconds": r.pause_seconds, "recovered": r.recovered}
