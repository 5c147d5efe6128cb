"""deltasync.trl with TRL from PyPI on the CPU: GRPOTrainer and RLOOTrainer train a tiny
Qwen-style model for a few steps with a rule-based reward while DeltaSyncCallback publishes every
optimizer step; an engine holding a second copy of the model follows through the store and is
bit-identical to the trainer after every step."""
import copy

import pytest
import torch

import trl  # scripts/requirements-trl.txt, installed by scripts/test
from transformers import TrainerCallback

import trl_tiny
from deltasync.trl import DeltaSyncCallback, SubscriberEngine

STEPS = 3


def bits(t):
    return t.detach().contiguous().view(torch.int16)


class CompareAfterEachStep(TrainerCallback):
    """Runs after DeltaSyncCallback (callbacks run in order): the receiver against the trainer."""

    def __init__(self, receiver, engine):
        self.receiver, self.engine, self.checked = receiver, engine, []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        assert self.engine.served_version == state.global_step
        trained = dict(model.named_parameters())
        received = dict(self.receiver.named_parameters())
        differing = [n for n, p in trained.items() if not torch.equal(bits(p), bits(received[n]))]
        assert not differing, f"step {state.global_step}: receiver differs in {differing[:3]}"
        self.checked.append(state.global_step)


def common_args(tmp_path):
    return dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, max_steps=STEPS, learning_rate=5e-3, logging_steps=1, report_to="none",
                save_strategy="no", use_vllm=False, use_cpu=True, seed=0, dataloader_num_workers=0,
                beta=0.0)  # no reference model: RLOO would load one from the hub by the model's name


def train_and_follow(tmp_path, trainer_cls, config_cls):
    tokenizer = trl_tiny.make_tokenizer()
    model = trl_tiny.make_model(tokenizer)
    receiver = copy.deepcopy(model)
    with torch.no_grad():  # the receiver starts elsewhere: only the store brings it to the trainer's weights
        for p in receiver.parameters():
            p.zero_()
    store = f"file://{tmp_path / 'store'}"
    engine = SubscriberEngine(receiver, store)
    # Only the first version anchors: this tiny model's deltas are about half its size, so the
    # default size rule (anchor_share) would anchor every other step.
    sync = DeltaSyncCallback(store, engine=engine, anchor_every=0, anchor_share=1e9)
    check = CompareAfterEachStep(receiver, engine)
    trainer = trainer_cls(model=model, args=config_cls(**common_args(tmp_path)), processing_class=tokenizer,
                          reward_funcs=trl_tiny.reward_letter_a, train_dataset=trl_tiny.prompts_dataset(),
                          callbacks=[sync, check])
    trainer.train()
    assert check.checked == list(range(1, STEPS + 1))
    reports = sync.reports
    assert [r.version for r in reports] == list(range(STEPS + 1))
    assert reports[0].anchor and not any(r.anchor for r in reports[1:])
    assert all(r.served_version == r.version and r.pause_seconds is not None for r in reports)
    # A step whose group rewards are all equal has no gradient: its delta is empty, not skipped.
    assert sum(r.changed_elements for r in reports[1:]) > 0, "training moved some weights"
    assert all(r.changed_elements < r.total_elements and 0 < r.delta_bytes < r.model_bytes for r in reports[1:])
    return reports


def test_grpo_trainer_publishes_every_step(tmp_path):
    train_and_follow(tmp_path, trl.GRPOTrainer, trl.GRPOConfig)


def test_rloo_trainer_publishes_every_step(tmp_path):
    train_and_follow(tmp_path, trl.RLOOTrainer, trl.RLOOConfig)


class FailingEngine(SubscriberEngine):
    def update(self, version):
        if version == 2:
            raise RuntimeError("engine cannot load version 2")
        return super().update(version)


def test_failed_update_leaves_the_engine_serving(tmp_path):
    from deltasync.trl import DeltaSync

    weights = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    received = {"w": torch.ones(64, dtype=torch.bfloat16)}
    store = f"file://{tmp_path / 'store'}"
    engine = FailingEngine(received, store)
    sync = DeltaSync(store, engine=engine, first_version=1)
    sync.publish(weights)
    weights["w"][3] = 1.5
    with pytest.raises(RuntimeError, match="cannot load version 2"):
        sync.publish(weights)
    assert not engine.paused and engine.served_version == 1
    assert torch.equal(received["w"], torch.zeros(64, dtype=torch.bfloat16))
    sync.close()
