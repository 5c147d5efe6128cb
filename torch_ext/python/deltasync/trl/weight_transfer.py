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
own (deltasync pull --follow, DeltaSubscriber.update()). With `follower` (a VLLMServerEngine) the
first version is published and made visible, then the server is put in follow mode
(VLLMServerEngine.follow): from then on the trainer's sync is the delta's staging only (the
upload runs in the background, the server picks each version up between its engine steps), and
pause()/resume() touch nothing."""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .engine import InferenceEngine
from .sync import DeltaSync, WeightSyncReport
from .vllm_server import VLLMServerEngine


class DeltaWeightTransfer:
    def __init__(self, store, engine: InferenceEngine | None = None, follower: VLLMServerEngine | None = None,
                 follow_poll_seconds: float = 1.0, **publisher_options):
        """`publisher_options` go to deltasync.DeltaPublisher (anchor_every, format, low_memory, ...)."""
        if engine is not None and follower is not None:
            raise ValueError("deltasync.trl.DeltaWeightTransfer: give an engine to drive or a follower, not both")
        # AsyncGRPOTrainer counts the policy it announces after a sync from 1.
        self.sync = DeltaSync(store, engine, first_version=1, **publisher_options)
        self.follower, self.follow_poll_seconds = follower, follow_poll_seconds

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
        if self.follower is None or self.follower.connected:
            self.sync.publish(iterator, resume=False)
            return
        # Following starts from a version the store holds (its set-up reads the anchor's headers);
        # the cold sync returns once the server serves it, so no rollout comes from weights of
        # its own loading, which carry no deltasync version.
        version = self.sync.publish(iterator, wait=True).version
        self.follower.follow(poll_seconds=self.follow_poll_seconds)
        deadline = time.monotonic() + self.follower.timeout
        while self.follower.weight_version() != version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"deltasync.trl.DeltaWeightTransfer: {self.follower.url} does not serve version "
                                   f"{version} {self.follower.timeout:.0f} s after following {self.follower.store}")
            time.sleep(self.follow_poll_seconds / 2)

    def resume(self) -> None:
        self.sync.resume_engine()

    def destroy(self) -> None:
        self.sync.close()
