"""One weight sync, shared by every TRL entry point: publish the trainer's weights as a version
(a delta against the last one, an anchor every `anchor_every`), and, when an inference engine is
attached, wait until the version is visible in the store, then pause the engine only for the
update itself. The upload happens while the engine keeps serving the previous version."""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

from ..publisher import DeltaPublisher, PublishStats
from ..sharded import ShardedDeltaPublisher, _dtensor_type
from .engine import InferenceEngine


@dataclass
class WeightSyncReport(PublishStats):
    """One weight sync: the publisher's stats of the version (every PublishStats field, refreshed
    once the version is visible: delta_bytes, anchor_bytes, upload_seconds, ...), plus what the
    trainer and the engine saw."""

    model_bytes: int = 0
    publish_seconds: float = 0.0  # inside the trainer: diff + staging, plus the wait for the upload when it waited
    pause_seconds: float | None = None  # engine paused (None: no engine, or not yet resumed)
    served_version: int | None = None  # what the engine serves after the update


def _is_dtensor(t) -> bool:
    return isinstance(t.data if isinstance(t, torch.nn.Parameter) else t, _dtensor_type())


SyncReport = WeightSyncReport  # its earlier name, kept for callers (docs/torch.md)
_STATS_FIELDS = [f.name for f in fields(PublishStats)]


class DeltaSync:
    """Publishes named tensors through a deltasync.DeltaPublisher and drives an optional engine.

    `publish(tensors)` accepts a module, a dict or an iterable of (name, tensor) pairs, the
    same names every call. The publisher keeps the tensors of the first call; later calls whose
    tensors are those same storages (a plain model's parameters) cost nothing extra, others (a
    gathered FSDP full_tensor(), a merged adapter copy) are copied into them first."""

    def __init__(self, store, engine: InferenceEngine | None = None, first_version: int = 0, **publisher_options):
        self.store = store
        self.first_version = first_version
        self.engine = engine
        self.publisher_options = publisher_options
        self.publisher: DeltaPublisher | None = None
        self.reports: list[WeightSyncReport] = []
        self._held: dict[str, torch.Tensor] | None = None
        self._paused_at: float | None = None
        self._last_version: int | None = None
        self._model_bytes = 0

    @property
    def next_version(self) -> int:
        return self.first_version if self._last_version is None else self._last_version + 1

    @torch.no_grad()
    def publish(self, tensors, version: int | None = None, wait: bool | None = None,
                resume: bool = True) -> WeightSyncReport:
        """Publishes `tensors` as `version` (default: the last one + 1, from first_version). With an engine
        (or wait=True) it returns once the version is visible and, with an engine, served; the
        engine is resumed unless resume=False (then call resume_engine())."""
        started = time.perf_counter()
        pairs = self._pairs(tensors)
        if self.publisher is None and any(_is_dtensor(t) for _, t in pairs):
            # A sharded trainer (FSDP2): every rank publishes its own shard, no full_tensor().
            # With resume=True it continues the store's last version (a delta from it).
            self.publisher = ShardedDeltaPublisher(pairs, self.store, **self.publisher_options)
            self._model_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
            if self.publisher.resumed_version is not None:
                self._last_version = self.publisher.resumed_version
        version = self.next_version if version is None else version
        if isinstance(self.publisher, ShardedDeltaPublisher):
            return self._publish_sharded(version, started, resume)
        self._stage(pairs)
        stats = self.publisher.publish(version)
        self._last_version = version
        wait = self.engine is not None if wait is None else wait
        if wait:
            self.publisher.flush()
        report = WeightSyncReport(model_bytes=self._model_bytes, publish_seconds=time.perf_counter() - started)
        self._fill_stats(report, stats)
        self.reports.append(report)
        if self.engine is not None:
            self._paused_at = time.perf_counter()
            self.engine.pause()
            try:
                report.served_version = self.engine.update(version)
            except BaseException:
                self.resume_engine()  # it serves what it served before; never leave it paused
                raise
            if resume:
                self.resume_engine()
        return report

    def _publish_sharded(self, version: int, started: float, resume: bool) -> WeightSyncReport:
        """Every rank: its part, committed once by the group. The engine (rank 0's) is updated
        once the version is visible, which it is when publish() returns."""
        outcome = self.publisher.publish(version)
        self._last_version = version
        report = WeightSyncReport(version=version, anchor=outcome["anchor"], visible=True,
                                  changed_elements=outcome["changed_elements"], delta_bytes=outcome["delta_bytes"],
                                  anchor_bytes=outcome["anchor_bytes"], model_bytes=self._model_bytes,
                                  publish_seconds=time.perf_counter() - started)
        self.reports.append(report)
        if self.engine is not None and self.publisher.rank == 0:
            self._paused_at = time.perf_counter()
            self.engine.pause()
            try:
                report.served_version = self.engine.update(version)
            except BaseException:
                self.resume_engine()
                raise
            if resume:
                self.resume_engine()
        return report

    def resume_engine(self) -> None:
        if self.engine is None or self._paused_at is None:
            return
        self.engine.resume()
        self.reports[-1].pause_seconds = time.perf_counter() - self._paused_at
        self._paused_at = None

    def flush(self) -> None:
        """Every published version visible in the store (the reports' upload figures filled in)."""
        if self.publisher is not None and not isinstance(self.publisher, ShardedDeltaPublisher):  # sharded: visible on return
            self.publisher.flush()
            self._refresh_reports()

    def close(self) -> None:
        try:
            if self.publisher is not None and not isinstance(self.publisher, ShardedDeltaPublisher):
                self.publisher.close()
                self._refresh_reports()
        finally:
            if self.engine is not None:
                self.engine.close()

    # ---- internals ---------------------------------------------------------------------------

    def _refresh_reports(self) -> None:
        by_version = {s.version: s for s in self.publisher.stats}
        for report in self.reports:
            if report.version in by_version:
                self._fill_stats(report, by_version[report.version])

    @staticmethod
    def _fill_stats(report: WeightSyncReport, stats: PublishStats) -> None:
        for name in _STATS_FIELDS:
            setattr(report, name, getattr(stats, name))

    @staticmethod
    def _pairs(tensors) -> list:
        if isinstance(tensors, torch.nn.Module):
            pairs = list(tensors.named_parameters())
        elif isinstance(tensors, dict):
            pairs = list(tensors.items())
        else:
            pairs = list(tensors) if isinstance(tensors, Iterable) else None
        if not pairs:
            raise ValueError("deltasync.trl: no tensors to publish")
        return pairs

    def _stage(self, pairs) -> None:
        if self.publisher is None:
            self._held = {name: t.detach() for name, t in pairs}
            self._model_bytes = sum(t.numel() * t.element_size() for t in self._held.values())
            self.publisher = DeltaPublisher(self._held, self.store, **self.publisher_options)
            return
        names = [name for name, _ in pairs]
        if names != list(self._held):
            missing = sorted(set(self._held) - set(names))
            extra = sorted(set(names) - set(self._held))
            raise ValueError(f"deltasync.trl: the tensors to publish changed since the first sync "
                             f"(missing {missing[:3]}, new {extra[:3]}); publish the same names every step")
        for name, t in pairs:
            held = self._held[name]
            if t.shape != held.shape or t.dtype != held.dtype:
                raise ValueError(f"deltasync.trl: tensor {name} is {t.dtype} {tuple(t.shape)} now but was "
                                 f"{held.dtype} {tuple(held.shape)} at the first sync")
            if t.data_ptr() != held.data_ptr():  # a gathered or merged copy: the publisher diffs its own tensors
                held.copy_(t)
