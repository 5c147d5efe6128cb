"""The receiving side of a sync, as the trainer sees it: something that can pause, move to a
published version and resume. Kept apart from the trainer glue so that each inference engine
(an in-process PyTorch model here; vLLM through its native weight-transfer routes in its own
module) is one small class."""
from __future__ import annotations

import threading
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
    receiver for a generation or evaluation model next to the trainer, and what the tests compare
    with the trainer. Whoever serves from the model holds `serving_lock` while it reads the
    weights; pause() takes the lock (waiting for the request in flight) and resume() releases it,
    so no request ever sees a half-updated model."""

    def __init__(self, model, store, serving_lock: threading.Lock | None = None, log=None):
        self.subscriber = DeltaSubscriber(model, store, log=log)
        self.serving_lock = serving_lock if serving_lock is not None else threading.Lock()
        self.served_version: int | None = None
        self.update_seconds: list[float] = []

    @property
    def paused(self) -> bool:
        return self.serving_lock.locked()

    def pause(self) -> None:
        self.serving_lock.acquire()

    def update(self, version: int) -> int:
        started = time.perf_counter()
        self.served_version = self.subscriber.update(version)
        self.update_seconds.append(time.perf_counter() - started)
        return self.served_version

    def resume(self) -> None:
        self.serving_lock.release()

    def close(self) -> None:
        pass
