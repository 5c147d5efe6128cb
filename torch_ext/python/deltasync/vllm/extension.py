"""DeltaWorkerExtension: methods vLLM mixes into every worker (--worker-extension-cls) and that
the engine calls with collective_rpc; the same worker subscriber as the native backend
(backend.py):

    deltasync_init(store, version=None)  refuse a model that cannot be updated in place, learn
                                         the HF -> runtime index maps (nothing written), write
                                         the anchor through the maps (audited against its
                                         digests), apply deltas up to `version`
    deltasync_update(version=None)       apply deltas in place up to `version` (default newest);
                                         returns {version, bytes, seconds, pause_seconds, ...}
    deltasync_poll()                     newest visible version in the store
    deltasync_version()                  version the weights are at

Each delta is applied by the C++ mapped receiver: positions mapped through the learned runs,
one gather of the bits it replaces, one scatter, digests verified per rank over the elements it
owns and summed across the tensor-parallel group; a mismatch rolls back on every rank.

The caller resets vLLM's prefix cache after an update (llm.reset_prefix_cache()): cached KV
blocks were computed with the old weights. The native backend does that itself.
"""
from __future__ import annotations

import torch

from . import rank_failures
from .worker_subscriber import WorkerSubscriber, tensor_parallel_group


def worker_model(worker) -> torch.nn.Module:
    runner = getattr(worker, "model_runner", None)
    # get_model() unwraps what recent vLLM wraps around the model (CUDA-graph wrappers).
    model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
    if model is None:
        raise RuntimeError("deltasync.vllm: cannot find the worker's model (model_runner.model)")
    return model


def worker_checkpoint(worker) -> str | None:
    config = getattr(worker, "vllm_config", None)
    return getattr(getattr(config, "model_config", None), "model", None)


class DeltaWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _deltasync_group(self):
        """(process group, rank) over which digest partials are summed."""
        return tensor_parallel_group()

    # init and update keep a failure for the engine core instead of raising it (rank_failures.py:
    # a raise on one rank desynchronizes vLLM's multiprocess executor); the engine core raises it.

    def deltasync_init(self, store: str, version: int | None = None) -> dict | None:
        return rank_failures.recorded(self, self._deltasync_start, store, version)

    def _deltasync_start(self, store: str, version: int | None) -> dict:
        group, rank = self._deltasync_group()
        sub = WorkerSubscriber(worker_model(self), checkpoint=worker_checkpoint(self), group=group, rank=rank)
        try:
            report = sub.start(store, version)
        except Exception:
            if sub.broken is not None:
                self._deltasync = sub  # its weights are torn: what deltasync_state reports, and a later update repairs
            raise
        self._deltasync = sub
        return report

    def deltasync_update(self, version: int | None = None) -> dict | None:
        return rank_failures.recorded(self, lambda: self._deltasync_subscriber().update(version))

    def deltasync_poll(self) -> int | None:
        return self._deltasync_subscriber().poll()

    def deltasync_version(self) -> int | None:
        return self._deltasync_subscriber().version

    def _deltasync_subscriber(self) -> WorkerSubscriber:
        sub = getattr(self, "_deltasync", None)
        if sub is None:
            raise RuntimeError("deltasync.vllm: call deltasync_init(store) first")
        return sub
