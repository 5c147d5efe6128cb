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
- in the engine core, refuses to serve weights that a failed anchor left torn (written part-way,
  no version): once a failed deltasync call leaves any worker torn, the weight version reads
  "broken", new requests are refused (finished at once with vLLM's request-level error, the
  reason logged), and no step is scheduled, until a later deltasync update succeeds on every rank;
- in the workers, adds `deltasync_state` (the version the worker's receiver holds, whether a
  weight-update session is open, why its weights are torn: what the engine core and the follower
  read) and `deltasync_take_failure`.

Every vLLM-internal name used here goes through compat.py, which checks them at import.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger("deltasync.vllm")

BACKEND = "deltasync"
_RESETS_AFTER = frozenset({"update_weights"})
_BACKEND_CALLS = frozenset({"init_weight_transfer_engine", "shutdown_weight_transfer_engine", "update_weights"})
_EXTENSION_CALLS = frozenset({"deltasync_init", "deltasync_update"})
# Calls whose workers keep a failure instead of raising it (rank_failures.py).
_KEEP_FAILURES = frozenset({"init_weight_transfer_engine", "update_weights"}) | _EXTENSION_CALLS


BROKEN = "broken"  # the weight version of an engine whose weights a failed anchor left torn
_BROKEN_ATTRIBUTE = "_deltasync_broken"  # on the engine core: why its weights are torn (None: they are not)


def register() -> None:
    from . import compat

    compat.register_weight_transfer_backend(BACKEND, "deltasync.vllm.backend", "DeltaSyncWeightTransferEngine")
    _patch_engine_core(compat)
    compat.add_worker_methods(deltasync_state=_worker_state, deltasync_take_failure=_take_failure)


def _uses_deltasync(engine_core) -> bool:
    config = getattr(getattr(engine_core, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == BACKEND


def broken_reason(engine_core) -> str | None:
    """Why the engine core's weights are torn (None: they hold a version, or the start checkpoint)."""
    return getattr(engine_core, _BROKEN_ATTRIBUTE, None)


def _patch_engine_core(compat) -> None:
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
                # Staler than the bound, or torn: no step until the follower caught up.
                return compat.take_refused(self), False
            if broken_reason(self) is not None:
                refused = compat.take_refused(self)
                if not refused:
                    time.sleep(0.05)  # torn weights: nothing is scheduled until an update succeeds
                return refused, False
            return original(self)

        return stepped

    def add_request(original):
        def add(self, request, request_wave=0):
            if broken_reason(self) is not None:
                follower = getattr(self, "_deltasync_follower", None)
                if follower is not None:
                    follower.between_steps(idle=True)  # a retry may be due: it may repair them
            if broken_reason(self) is not None:
                logger.error("deltasync: request %s refused: the served weights are torn (%s); apply a version "
                             "(update_weights) first", request.request_id, broken_reason(self))
                compat.refuse_request(self, request)
                return None
            return original(self, request, request_wave)

        return add

    def client_request(original):
        def handle(self, request_type, request):
            original(self, request_type, request)
            follower = getattr(self, "_deltasync_follower", None)
            if follower is not None:
                follower.between_steps(idle=True)

        return handle

    compat.wrap_engine_core(collective_rpc=rpc, step=step, add_request=add_request, client_request=client_request)


def _init_info(args, kwargs) -> dict:
    info = (kwargs or {}).get("init_info", args[0] if args else {})
    return info if isinstance(info, dict) else {}


def _raise_kept_failure(engine_core, rpc, method: str) -> None:
    """Every rank has replied: the first failure a worker kept is raised here, after closing the
    weight-update session that a failed update_weights leaves open on the workers (as vLLM's
    worker does when an update raises)."""
    from . import rank_failures

    failures = rpc(engine_core, "deltasync_take_failure")
    if method != "init_weight_transfer_engine":  # an update, or the extension's init (which updates)
        _note_torn_weights(engine_core, rpc, failed=any(failures))
    if not any(failures):
        return
    if method == "update_weights":
        rpc(engine_core, "finish_weight_update")
    rank_failures.raise_first(failures)


def _note_torn_weights(engine_core, rpc, failed: bool) -> None:
    """After a deltasync update: torn when a failure left any worker's weights part-way through
    an anchor; whole again once an update succeeded on every rank."""
    was = broken_reason(engine_core)
    if not failed:
        if was is not None:
            setattr(engine_core, _BROKEN_ATTRIBUTE, None)
            versions = sorted({str(state["version"]) for state in rpc(engine_core, "deltasync_state")})
            if len(versions) == 1:  # the label until a caller sets its own (finish_weight_update(version))
                engine_core.set_weight_version(versions[0])
            logger.warning("deltasync: the served weights hold version %s again; serving resumes", "/".join(versions))
        return
    if was is not None:
        return  # still torn (a failure before any write leaves them as they were)
    reasons = [state["broken"] for state in rpc(engine_core, "deltasync_state") if state.get("broken")]
    if reasons:
        setattr(engine_core, _BROKEN_ATTRIBUTE, reasons[0])
        engine_core.set_weight_version(BROKEN)
        logger.error("deltasync: the served weights are torn (%s): no requests are served until a later update "
                     "succeeds", reasons[0])


def _stop_following(engine_core) -> None:
    follower = getattr(engine_core, "_deltasync_follower", None)
    if follower is not None:
        follower.stop()
        engine_core._deltasync_follower = None


def _worker_state(worker) -> dict:
    """The version this worker's deltasync receiver holds (backend or worker extension; None:
    none yet, or torn), whether a weight-update session is open on it, and why its weights are
    torn (None: they are not)."""
    from . import compat

    subscriber = getattr(getattr(worker, "weight_transfer_engine", None), "subscriber", None)
    subscriber = subscriber or getattr(worker, "_deltasync", None)
    return {"version": None if subscriber is None else subscriber.version,
            "updating": compat.weight_update_open(worker),
            "broken": None if subscriber is None else subscriber.broken}


def _take_failure(worker):
    from . import rank_failures

    return rank_failures.take(worker, getattr(worker, "weight_transfer_engine", None))
