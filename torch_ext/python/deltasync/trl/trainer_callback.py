"""deltasync for TRL's synchronous trainers (GRPOTrainer, RLOOTrainer, any transformers Trainer):
a callback that publishes the policy after every optimizer step.

    from deltasync.trl import DeltaSyncCallback
    trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=False, ...), reward_funcs=...,
                          callbacks=[DeltaSyncCallback("s3://bucket/run")])

Version N is the weights after optimizer step N (version 0: the weights training starts from,
an anchor). With an engine, each step waits until its version is visible and served (the
engine paused only for the update); without one the upload overlaps the next step and
receivers follow the store on their own. The callback must see the same parameters on every
step: a single process, rank 0 of a run whose parameters are whole there, or -- FSDP2
(DTensor) parameters -- every rank, each publishing its own shard (deltasync.ShardedDeltaPublisher:
no full_tensor(), one commit per step; an engine is driven by rank 0)."""
from __future__ import annotations

import logging

from transformers import TrainerCallback

from .engine import InferenceEngine
from .sync import DeltaSync

logger = logging.getLogger(__name__)


def _policy(model):
    """The parameters a receiver loads: the trainable ones, under the names of the unwrapped model."""
    model = getattr(model, "module", model)  # DDP
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _sharded(pairs) -> bool:
    """FSDP2 / DTensor parameters: every rank publishes its own shard (ShardedDeltaPublisher)."""
    return any(type(p.data).__name__ == "DTensor" for _, p in pairs)


class DeltaSyncCallback(TrainerCallback):
    def __init__(self, store, engine: InferenceEngine | None = None, **publisher_options):
        """`publisher_options` go to deltasync.DeltaPublisher (anchor_every, format, low_memory, ...)."""
        self.sync = DeltaSync(store, engine, **publisher_options)

    @property
    def reports(self):
        return self.sync.reports

    def _publish(self, state, model) -> None:
        pairs = _policy(model)
        if state.is_world_process_zero or _sharded(pairs):
            self.sync.publish(pairs, version=state.global_step)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if getattr(args, "use_vllm", False):
            logger.warning("deltasync.trl.DeltaSyncCallback: use_vllm=True, so TRL still sends the weights to vLLM "
                           "itself; the callback publishes them to the store in addition")
        if self.sync.publisher is None:
            self._publish(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._publish(state, model)

    def on_train_end(self, args, state, control, **kwargs):
        self.sync.close()
