"""deltasync as the `weight_transfer` of TRL's experimental AsyncGRPOTrainer (its
WeightTransferProtocol: init_weight_transfer, pause, send_weights(iterator), resume, destroy).

The trainer calls pause() before send_weights(). Pausing is deferred: the engine keeps serving
the previous version while the delta is diffed and uploaded, and is paused only once the new
version is visible in the store, for the update itself; resume() ends that pause.

    from deltasync.trl import DeltaWeightTransfer
    trainer = AsyncGRPOTrainer(model=..., args=..., reward_funcs=...,
                               weight_transfer=DeltaWeightTransfer("s3://bucket/run", engine=...))

Store versions are the trainer's policy versions (`model_version`, which the rollout worker tags
samples with): the cold sync at train begin publishes version 1, an anchor.

Without an engine the versions are only published; receivers then follow the store on their
own (deltasync pull --follow, DeltaSubscriber.update())."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .engine import InferenceEngine
from .sync import DeltaSync, WeightSyncReport


class DeltaWeightTransfer:
    def __init__(self, store, engine: InferenceEngine | None = None, **publisher_options):
        """`publisher_options` go to deltasync.DeltaPublisher (anchor_every, format, low_memory, ...)."""
        # AsyncGRPOTrainer counts the policy it announces after a sync from 1.
        self.sync = DeltaSync(store, engine, first_version=1, **publisher_options)

    @property
    def reports(self) -> list[WeightSyncReport]:
        return self.sync.reports

    def init_weight_transfer(self) -> None:
        # The store needs no handshake and the first send_weights() publishes an anchor.
        pass

    def pause(self) -> None:
        # Deferred to send_weights(): see the module docstring.
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.sync.publish(iterator, resume=False)

    def resume(self) -> None:
        self.sync.resume_engine()

    def destroy(self) -> None:
        self.sync.close()
