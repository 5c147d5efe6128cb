"""vLLM general plugin (entry point `vllm.general_plugins` -> deltasync.vllm.plugin:register),
loaded by vLLM in every process it starts (engine core, workers, API server):

- registers the weight-transfer backend "deltasync" (backend.py), imported lazily;
- in the engine core, resets the prefix cache after every deltasync `update_weights`
  (running requests are preempted and recomputed): KV blocks computed with the old weights must
  not serve prompts after the change. The worker-side backend cannot reach the scheduler, so
  the engine core's collective_rpc is wrapped for that method;
- in the engine core, runs the follower of an `init_weight_transfer_engine` whose init_info asks
  to follow the store (follow.py): started after the workers connected, stopped by
  `shutdown_weight_transfer_engine` or a new init, called between engine steps (EngineCore.step
  and step_with_batch_queue, and after each client request of an idle engine core);
- in the engine core, raises the failures the workers kept of a deltasync init or update once
  every rank has replied (rank_failures.py: why they are not raised on the workers);
- in the workers, adds `deltasync_state` (the version the worker's receiver holds, whether a
  weight-update session is open: what the follower reads) and `deltasync_take_failure`.
"""
from __future__ import annotations

BACKEND = "deltasync"
_RESETS_AFTER = frozenset({"update_weights"})
_BACKEND_CALLS = frozenset({"init_weight_transfer_engine", "shutdown_weight_transfer_engine", "update_weights"})
_EXTENSION_CALLS = frozenset({"deltasync_init", "deltasync_update"})
# Calls whose workers keep a failure instead of raising it (rank_failures.py).
_KEEP_FAILURES = frozenset({"init_weight_transfer_engine", "update_weights"}) | _EXTENSION_CALLS
_PATCHED = "_deltasync_patched"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "deltasync.vllm.backend", "DeltaSyncWeightTransferEngine")
    _patch_engine_core()
    _patch_worker()


def _uses_deltasync(engine_core) -> bool:
    config = getattr(getattr(engine_core, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == BACKEND


def _patched(cls, name: str, make) -> None:
    original = getattr(cls, name)
    if getattr(original, _PATCHED, False):
        return
    wrapper = make(original)
    setattr(wrapper, _PATCHED, True)
    setattr(cls, name, wrapper)


def _patch_engine_core() -> None:
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    def rpc(original):
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            backend = _uses_deltasync(self) and method in _BACKEND_CALLS
            if not (backend or method in _EXTENSION_CALLS):
                return original(self, method, timeout, args, kwargs)
            follow = None
            if method == "init_weight_transfer_engine":
                from .follow import FollowOptions

                follow = FollowOptions.from_init_info(_init_info(args, kwargs))  # refused before the workers see it
                _stop_following(self)
            elif method == "shutdown_weight_transfer_engine":
                _stop_following(self)
            result = original(self, method, timeout, args, kwargs)
            if method in _KEEP_FAILURES:
                _raise_kept_failure(self, original, method)
            if backend and method in _RESETS_AFTER:
                self.reset_prefix_cache(reset_running_requests=True)
                follower = getattr(self, "_deltasync_follower", None)
                if follower is not None and not follower.updating:
                    follower.after_external_update()
            if follow is not None:
                from .follow import StoreFollower

                self._deltasync_follower = StoreFollower(self, follow)
            return result

        return collective_rpc

    def step(original):
        def stepped(self):
            follower = getattr(self, "_deltasync_follower", None)
            if follower is not None and not follower.between_steps():
                return {}, False  # staler than the bound: no step until the follower caught up
            return original(self)

        return stepped

    def client_request(original):
        def handle(self, request_type, request):
            original(self, request_type, request)
            follower = getattr(self, "_deltasync_follower", None)
            if follower is not None:
                follower.between_steps(idle=True)

        return handle

    _patched(EngineCore, "collective_rpc", rpc)
    _patched(EngineCore, "step", step)
    _patched(EngineCore, "step_with_batch_queue", step)
    _patched(EngineCoreProc, "_handle_client_request", client_request)


def _init_info(args, kwargs) -> dict:
    info = (kwargs or {}).get("init_info", args[0] if args else {})
    return info if isinstance(info, dict) else {}


def _raise_kept_failure(engine_core, rpc, method: str) -> None:
    """Every rank has replied: the first failure a worker kept is raised here, after closing the
    weight-update session that a failed update_weights leaves open on the workers (as vLLM's
    worker does when an update raises)."""
    from . import rank_failures

    failures = rpc(engine_core, "deltasync_take_failure")
    if not any(failures):
        return
    if method == "update_weights":
        rpc(engine_core, "finish_weight_update")
    rank_failures.raise_first(failures)


def _stop_following(engine_core) -> None:
    follower = getattr(engine_core, "_deltasync_follower", None)
    if follower is not None:
        follower.stop()
        engine_core._deltasync_follower = None


def _patch_worker() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, "deltasync_state"):
        WorkerBase.deltasync_state = _worker_state
        WorkerBase.deltasync_take_failure = _take_failure


def _worker_state(worker) -> dict:
    """The version this worker's deltasync receiver holds (backend or worker extension; None:
    none yet) and whether a weight-update session is open on it."""
    subscriber = getattr(getattr(worker, "weight_transfer_engine", None), "subscriber", None)
    subscriber = subscriber or getattr(worker, "_deltasync", None)
    return {"version": None if subscriber is None else subscriber.version,
            "updating": bool(getattr(worker, "_weight_update_active", False))}


def _take_failure(worker):
    from . import rank_failures

    return rank_failures.take(worker, getattr(worker, "weight_transfer_engine", None))
