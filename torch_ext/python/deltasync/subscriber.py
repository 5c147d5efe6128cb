"""Inference side: DeltaSubscriber brings a set of named tensors (any PyTorch model, on the CPU
or a GPU) to a published version in place, through the C++ Subscriber (host/sync/subscriber.hpp):
poll() finds the newest version with a conditional read of LATEST, update() plans the cheapest
catch-up (the chain of deltas from the current version, or an anchor plus the deltas after it),
fetches every object with its SHA-256 checked, and applies each delta with the engine where the
tensors live -- decoded there, base digests checked before anything is written, result digests
after, in O(changed); a failed check leaves every tensor bit-for-bit as it was and recovers from
the newest anchor. Nothing here but passing the tensors in.

    sub = deltasync.DeltaSubscriber(model, store="file:///bucket")
    sub.update()           # newest version; returns the version reached
    sub.last_report        # bytes, seconds, pause, host<->device traffic
"""
from __future__ import annotations

from dataclasses import fields

import torch

from ._library import native
from ._params import named_tensors
from ._records import record_class, update_report_rows
from .errors import IntegrityError, WrongBaseError  # noqa: F401  (re-exported: deltasync.subscriber.IntegrityError)


# What one update did: the fields of the C++ SyncReport (sync_report_fields() in
# host/sync/subscriber.hpp).
UpdateReport = record_class("UpdateReport", update_report_rows(), "What one update did (C++ SyncReport).",
                            module=__name__)

_REPORT_FIELDS = {f.name for f in fields(UpdateReport)}


def report_from(d: dict) -> UpdateReport:
    return UpdateReport(**{k: v for k, v in d.items() if k in _REPORT_FIELDS})


class DeltaSubscriber:
    def __init__(self, model, store, log=None, _native=None):
        self.store = str(store)
        if _native is None:
            named = named_tensors(model)
            _native = native().Subscriber(self.store, [n for n, _ in named], [t for _, t in named], log)
        self._native = _native
        self.last_report: UpdateReport | None = None
        self.reports: list[UpdateReport] = []

    @property
    def version(self) -> int | None:
        """The version the tensors are at (None: unknown)."""
        return self._native.version

    def poll(self) -> int | None:
        """The newest visible version (None: nothing published yet)."""
        return self._native.poll()

    def has_version(self, version: int) -> bool:
        """True when the store holds version `version` (its manifest is visible)."""
        return self._native.has_version(int(version))

    @torch.no_grad()
    def update(self, version: int | None = None, audit: bool = False) -> int:
        """Brings the tensors to `version` (default: the newest) in place; returns the version.

        Digests are tracked in O(changed) per delta; audit=True first recomputes them from the
        weights (one read) so that writes into the weights from elsewhere are found (and
        repaired from an anchor)."""
        report = report_from(self._native.update(None if version is None else int(version), bool(audit)))
        self.last_report = report
        self.reports.append(report)
        return self.version

    def digests(self) -> dict[str, int]:
        """The tensors' digests as tracked (name -> unsigned 64-bit)."""
        return self._native.digests()

    def recompute_digests(self) -> None:
        """Re-reads the weights' digests: call after writing into the tensors yourself, so that the
        next update sees what they hold (and refuses deltas made for what they held before)."""
        self._native.recompute_digests()
