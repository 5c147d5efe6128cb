"""vLLM general plugin (entry point `vllm.general_plugins` -> deltasync.vllm.plugin:register),
loaded by vLLM in every process it starts (engine core, workers, API server):

- registers the weight-transfer backend "deltasync" (backend.py), imported lazily;
- in the engine core, resets the prefix cache after every deltasync `update_weights`
  (running requests are preempted and recomputed): KV blocks computed with the old weights must
  not serve prompts after the change. The worker-side backend cannot reach the scheduler, so
  the engine core's collective_rpc is wrapped for that one method.
"""
from __future__ import annotations

BACKEND = "deltasync"
_RESETS_AFTER = frozenset({"update_weights"})


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "deltasync.vllm.backend", "DeltaSyncWeightTransferEngine")
    _reset_prefix_cache_after_updates()


def _uses_deltasync(engine_core) -> bool:
    config = getattr(getattr(engine_core, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == BACKEND


def _reset_prefix_cache_after_updates() -> None:
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.collective_rpc
    if getattr(original, "_deltasync_resets_prefix_cache", False):
        return

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        result = original(self, method, timeout, args, kwargs)
        if method in _RESETS_AFTER and _uses_deltasync(self):
            self.reset_prefix_cache(reset_running_requests=True)
        return result

    collective_rpc._deltasync_resets_prefix_cache = True
    EngineCore.collective_rpc = collective_rpc
