"""DeltaWorkerExtension: methods vLLM mixes into every worker (--worker-extension-cls) and that
the engine calls with collective_rpc; the same receiver code as the native backend (backend.py):

    deltasync_init(store, version=None)  refuse a model that cannot be updated in place, learn
                                         the HF -> runtime index maps (nothing written), load
                                         the newest anchor, apply deltas up to `version`
    deltasync_update(version=None)       apply deltas in place up to `version` (default newest);
                                         returns {version, bytes, seconds, pause_seconds, ...}
    deltasync_poll()                     newest visible version in the store
    deltasync_version()                  version the weights are at

The caller resets vLLM's prefix cache after an update (llm.reset_prefix_cache()): cached KV
blocks were computed with the old weights. The native backend does that itself.
"""
from __future__ import annotations

import torch

from .follower import StoreFollower


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

    def deltasync_init(self, store: str, version: int | None = None) -> dict:
        follower = StoreFollower(worker_model(self), checkpoint=worker_checkpoint(self))
        report = follower.start(store, version)
        self._deltasync = follower
        return report

    def deltasync_update(self, version: int | None = None) -> dict:
        return self._deltasync_follower().update(version)

    def deltasync_poll(self) -> int | None:
        return self._deltasync_follower().poll()

    def deltasync_version(self) -> int | None:
        return self._deltasync_follower().version

    def _deltasync_follower(self) -> StoreFollower:
        follower = getattr(self, "_deltasync", None)
        if follower is None:
            raise RuntimeError("deltasync.vllm: call deltasync_init(store) first")
        return follower
