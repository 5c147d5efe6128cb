"""The receiving side of a sync, as the trainer sees it: something that can pause, move to a
published version and resume. Kept apart from the trainer glue so that each inference engine
(an in-process PyTorch model here; vLLM through its native weight-transfer routes in its own
module) is one small class."""
from __future__ import annotations

import time
from typing import Protocol

from ..subscriber import DeltaSubscriber


class InferenceEngine(Protocol):
    def pause(self) -> None:
        """Stop serving requests until resume() (weights are about to change)."""

    def update(self, version: int) -> int:
        """Bring the served weights to `version` (already visible in the store); returns the
        version now served."""

    def resume(self) -> None:
        """Serve again."""

    def close(self) -> None:
        """Release what the engine holds."""


class SubscriberEngine:
    """A PyTorch model in this process that follows the store through a DeltaSubscriber: the
    receiver for a trainer-side evaluator or a generation model on the trainer's machine, and the
    receiver the tests compare with the trainer. Nothing runs on it concurrently, so pause and
    resume only mark the window the update happened in."""

    def __init__(self, model, store, log=None):
        self.subscriber = DeltaSubscriber(model, store, log=log)
        self.paused = False
        self.served_version: int | None = None
        self.update_seconds: list[float] = []

    def pause(self) -> None:
        self.paused = True

    def update(self, version: int) -> int:
        started = time.perf_counter()
        self.served_version = self.subscriber.update(version)
        self.update_seconds.append(time.perf_counter() - started)
        return self.served_version

    def resume(self) -> None:
        self.paused = False

    def close(self) -> None:
        pass
