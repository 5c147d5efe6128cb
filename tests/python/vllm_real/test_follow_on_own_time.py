"""A real vLLM engine that follows a store on its own time: init_weight_transfer_engine with
"follow": true, then no weight-transfer call at all. New versions are applied between engine
steps by the engine core's follower (deltasync/vllm/follow.py), labelled as the served weight
version (get_weight_version, and every output's weight_versions spans), and the weights are
bit-identical to what vLLM's own loader makes of that version's checkpoint. With a staleness
bound, an engine that cannot reach the newest version stops generating once the bound is passed
and resumes when it has caught up."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import deltasync
import engine as eng
import tiny_models as tm
from test_follow_store import sparse_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python: store_tamper
import store_tamper  # noqa: E402

BACKEND = {"weight_transfer_config": {"backend": "deltasync"}}
POLL = 0.05
DEADLINE = 120  # seconds allowed for the follower to catch up on this 2-core machine (not a timing target)


class Trainer:
    """Publishes versions of a tiny model and keeps each as an HF checkpoint (the oracle)."""

    def __init__(self, tmp_path: Path, kind=tm.qwen3):
        self.tmp_path = tmp_path
        self.model = tm.make(kind, seed=0)
        self.store_dir = tmp_path / "bucket"
        self.store = f"file://{self.store_dir}"
        self.pub = deltasync.DeltaPublisher(self.model, store=self.store)
        self.checkpoints: dict[int, Path] = {}

    def publish(self, version: int, force_anchor: bool = False) -> None:
        if version:
            sparse_step(self.model, version)
        self.pub.publish(version, anchor=force_anchor or None)
        self.pub.flush()
        self.checkpoints[version] = tm.save(self.model, self.tmp_path / f"v{version}")

    def close(self) -> None:
        self.pub.close()


def _follower(llm):
    # The in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0 in conftest).
    return llm.llm_engine.engine_core.engine_core._deltasync_follower


def _spans(llm) -> list[list[str]]:
    """Generates PROMPTS; per request, the weight versions of its output's spans."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in eng.PROMPTS],
                        SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    return [[s.version for s in (o.outputs[0].weight_versions or [])] for o in outs]


def _generate_until_served(llm, version: int) -> list[list[list[str]]]:
    """Generates until every output was sampled with `version` (the engine follows while it
    steps); every batch's spans, in order."""
    batches = []
    give_up = time.monotonic() + DEADLINE
    while time.monotonic() < give_up:
        batches.append(_spans(llm))
        if all(spans and spans[-1] == str(version) for spans in batches[-1]):
            return batches
        time.sleep(POLL)
    raise AssertionError(f"the engine did not serve version {version}: {batches[-3:]}, {_follower(llm).status()}")


def _assert_serves_checkpoint(llm, checkpoint: Path) -> None:
    """vLLM's own loader puts `checkpoint` into copies of the runtime tensors; every copy must
    equal the served tensor bit for bit (check_served_weights raises otherwise)."""
    def check(worker):
        from deltasync.vllm.updatable import check_served_weights, checkpoint_files

        return check_served_weights(worker.model_runner.get_model(), checkpoint_files(str(checkpoint)))

    assert all(n > 0 for n in llm.collective_rpc(check))


def _labels_ascend(batches) -> bool:
    """Within a request, each span is a newer version than the one before (an update between two
    steps of the request shows as a second span); a later batch never goes back."""
    floor = -1
    for batch in batches:
        numbers = [[-1 if v == "default" else int(v) for v in spans] for spans in batch]
        if any(n != sorted(set(n)) or n[0] < floor for n in numbers):
            return False
        floor = max(n[-1] for n in numbers)
    return True


def test_engine_follows_the_store_between_steps_with_no_update_calls(tmp_path):
    trainer = Trainer(tmp_path)
    try:
        trainer.publish(0)
        with eng.engine(tm.save(tm.make(tm.qwen3, seed=1), tmp_path / "start"), **BACKEND) as llm:
            llm.init_weight_transfer_engine({"init_info": {"store": trainer.store, "follow": True, "poll_seconds": POLL}})
            batches = _generate_until_served(llm, 0)  # the anchor, brought in by the follower
            _assert_serves_checkpoint(llm, trainer.checkpoints[0])
            for v in (1, 2):
                trainer.publish(v)
                batches += _generate_until_served(llm, v)
                assert llm.get_weight_version() == str(v)
                _assert_serves_checkpoint(llm, trainer.checkpoints[v])
            status = _follower(llm).status()
            assert _labels_ascend(batches), batches
            # Anchor, then one delta per version: each version applied once, none skipped back.
            assert status["served"] == 2 and status["updates"] == 3 and status["last_error"] is None, status
            assert status["last_update"]["version"] == 2 and status["staleness_seconds"] == 0.0, status
            # A request after the follower is stopped: the weights stay where they are.
            llm.shutdown_weight_transfer_engine()
            trainer.publish(3)
            time.sleep(5 * POLL)
            assert all(spans == ["2"] for spans in _spans(llm))
            # Connected again, now driven by the caller: the weights are deltasync's version 2,
            # not the engine's checkpoint any more, and the engine takes version 3 from there.
            llm.init_weight_transfer_engine({"init_info": {"store": trainer.store}})
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": 3}})
            llm.finish_weight_update("3")
            _assert_serves_checkpoint(llm, trainer.checkpoints[3])
    finally:
        trainer.close()


def test_engine_past_its_staleness_bound_waits_until_it_has_caught_up(tmp_path):
    trainer = Trainer(tmp_path)
    bound = 4.0  # seconds: room for a refused attempt and a batch within it on 2 shared cores
    try:
        trainer.publish(0)
        trainer.publish(1)
        with eng.engine(tm.save(tm.make(tm.qwen3, seed=1), tmp_path / "start"), **BACKEND) as llm:
            llm.init_weight_transfer_engine({"init_info": {"store": trainer.store, "follow": True, "poll_seconds": POLL,
                                                           "max_staleness_seconds": bound}})
            _generate_until_served(llm, 1)
            # Version 2 promises a result its changes do not produce: every attempt is refused
            # (and rolled back) by the receiver; the engine keeps serving version 1.
            trainer.publish(2)
            store_tamper.tamper_result_digest(trainer.store_dir, 2, "model.embed_tokens.weight")
            follower = _follower(llm)
            give_up = time.monotonic() + DEADLINE
            while follower.newest_seen() != 2 and time.monotonic() < give_up:
                time.sleep(POLL)
            assert follower.newest_seen() == 2
            # Within the bound the engine still generates with version 1 (after a refused attempt).
            assert all(spans == ["1"] for spans in _spans(llm))
            assert follower.served == 1 and "version 2 failed" in (follower.last_error or ""), follower.status()
            time.sleep(bound + 0.5)
            results: list = []
            generating = threading.Thread(target=lambda: results.append(_spans(llm)))
            generating.start()
            generating.join(timeout=3.0)
            # Past the bound no step runs: the requests wait instead of being served stale weights.
            assert generating.is_alive() and not results, results
            assert follower.status()["stalled"] and follower.served == 1, follower.status()
            assert llm.get_weight_version() == "1"
            # The trainer publishes an anchor: the follower reaches it, and the requests that
            # waited are served by it alone.
            trainer.publish(3, force_anchor=True)
            generating.join(timeout=DEADLINE)
            assert not generating.is_alive()
            assert len(results) == 1 and all(spans == ["3"] for spans in results[0]), results
            assert llm.get_weight_version() == "3" and not follower.status()["stalled"]
            _assert_serves_checkpoint(llm, trainer.checkpoints[3])
    finally:
        trainer.close()


def test_tensor_parallel_engine_follows_and_keeps_serving_after_a_refused_version(tmp_path):
    """TP=2 (workers in their own processes; one KV head replicated on both ranks): the follower
    brings both ranks along, and after a version every rank refuses it asks the workers where
    they are and labels the weights with that."""
    trainer = Trainer(tmp_path, tm.qwen2_single_kv_head)
    try:
        trainer.publish(0)
        with eng.engine(tm.save(tm.make(tm.qwen2_single_kv_head, seed=1), tmp_path / "start"), 2, **BACKEND) as llm:
            llm.init_weight_transfer_engine({"init_info": {"store": trainer.store, "follow": True, "poll_seconds": POLL}})
            trainer.publish(1)
            _generate_until_served(llm, 1)
            _assert_serves_checkpoint(llm, trainer.checkpoints[1])
            trainer.publish(2)
            store_tamper.tamper_result_digest(trainer.store_dir, 2, "model.embed_tokens.weight")
            follower = _follower(llm)
            give_up = time.monotonic() + DEADLINE
            while "version 2 failed" not in (follower.last_error or "") and time.monotonic() < give_up:
                _spans(llm)
            assert follower.served == 1 and llm.get_weight_version() == "1", follower.status()
            assert all(spans == ["1"] for spans in _spans(llm))
            _assert_serves_checkpoint(llm, trainer.checkpoints[1])
    finally:
        trainer.close()
