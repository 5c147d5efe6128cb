"""deltasync as TRL's weight sync (docs/torch.md, "TRL").

    from deltasync.trl import DeltaSyncCallback, DeltaWeightTransfer, SubscriberEngine

- DeltaSyncCallback(store, engine=None, **publisher_options): GRPOTrainer / RLOOTrainer (any
  transformers Trainer) publish after every optimizer step, through `callbacks=[...]`.
- DeltaWeightTransfer(store, engine=None, **publisher_options): the `weight_transfer` of
  trl.experimental.async_grpo.AsyncGRPOTrainer.
- engines: SubscriberEngine (a PyTorch model in this process following the store); anything
  with pause(), update(version), resume(), close() (InferenceEngine) can be driven.
"""
from __future__ import annotations

from .engine import InferenceEngine, SubscriberEngine
from .sync import DeltaSync, SyncReport
from .weight_transfer import DeltaWeightTransfer

__all__ = ["DeltaSync", "DeltaSyncCallback", "DeltaWeightTransfer", "InferenceEngine", "SubscriberEngine",
           "SyncReport"]


def __getattr__(name):
    # The callback subclasses transformers.TrainerCallback: transformers is imported only when it is used.
    if name == "DeltaSyncCallback":
        from .trainer_callback import DeltaSyncCallback

        return DeltaSyncCallback
    raise AttributeError(f"module 'deltasync.trl' has no attribute {name!r}")
