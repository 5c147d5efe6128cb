"""deltasync as TRL's weight sync (docs/torch.md, "TRL").

    from deltasync.trl import DeltaSyncCallback, DeltaWeightTransfer, SubscriberEngine

- DeltaSyncCallback(store, engine=None, **publisher_options): GRPOTrainer / RLOOTrainer (any
  transformers Trainer) publish after every optimizer step, through `callbacks=[...]`.
- DeltaWeightTransfer(store, engine=None, **publisher_options): the `weight_transfer` of
  trl.experimental.async_grpo.AsyncGRPOTrainer.
- DeltaSyncGRPOTrainer(..., deltasync_store=URL): GRPOTrainer with `use_vllm=True,
  vllm_mode="server"`, generating through a stock `vllm serve` (/v1/completions) and syncing
  through the store instead of NCCL (vllm_generation.py).
- DeltaSyncAsyncGRPOTrainer(..., deltasync_store=URL): AsyncGRPOTrainer with a `vllm serve`
  following the store on its own time, rollouts tagged with the version that generated them,
  and a CPU twin of TRL's FlashAttention-3 tree attention (async_grpo.py).
- engines: SubscriberEngine (a PyTorch model in this process following the store),
  VLLMServerEngine (a `vllm serve` process with the deltasync weight-transfer backend, through its
  HTTP routes); anything with pause(), update(version), resume(), close() (InferenceEngine) can be
  driven.
"""
from __future__ import annotations

from .engine import InferenceEngine, SubscriberEngine
from .sync import DeltaSync, SyncReport, WeightSyncReport
from .vllm_server import VLLMServerEngine, VLLMServerError
from .weight_transfer import DeltaWeightTransfer

__all__ = ["DeltaSync", "DeltaSyncAsyncGRPOTrainer", "DeltaSyncCallback", "DeltaSyncGRPOTrainer", "DeltaWeightTransfer",
           "InferenceEngine", "SubscriberEngine", "SyncReport", "VLLMServerEngine", "VLLMServerError", "WeightSyncReport"]


def __getattr__(name):
    # The callback subclasses transformers.TrainerCallback: transformers is imported only when it is used.
    if name == "DeltaSyncCallback":
        from .trainer_callback import DeltaSyncCallback

        return DeltaSyncCallback
    if name == "DeltaSyncGRPOTrainer":  # subclasses trl.GRPOTrainer: trl imported only when used
        from .vllm_generation import _grpo_trainer_class

        return _grpo_trainer_class()
    if name == "DeltaSyncAsyncGRPOTrainer":  # subclasses trl's AsyncGRPOTrainer: trl imported only when used
        from .async_grpo import _async_trainer_class

        return _async_trainer_class()
    raise AttributeError(f"module 'deltasync.trl' has no attribute {name!r}")
