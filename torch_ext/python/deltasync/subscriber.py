"""Inference side: DeltaSubscriber brings a set of named tensors (any PyTorch model) to a
published version in place: poll() finds the newest version, update() plans the cheapest
catch-up (the chain of deltas from the current version, or an anchor plus the deltas after it),
fetches every object with its SHA-256 checked, and applies each delta with one
torch.ops.deltasync.apply over all changed tensors. Digests are checked before (the base must be
what the delta expects) and after (O(changed)); a failed check restores the touched elements and
recovers from the newest anchor.

    sub = deltasync.DeltaSubscriber(model, store="file:///bucket")
    sub.update()           # newest version; returns the version reached
    sub.last_report        # bytes, seconds, pause
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import ops
from ._files import ParsedDelta, parse_anchor_part, parse_delta, rebase_values
from ._params import int_view, named_tensors, to_device
from ._protocol import Catalog, Manifest, fetch_verified
from ._store import open_store

MASK = (1 << 64) - 1


class IntegrityError(RuntimeError):
    """A delta does not fit the weights it would be applied to (or did not produce what it promised)."""


@dataclass
class UpdateReport:
    from_version: int | None = None
    to_version: int | None = None
    anchor: int | None = None
    deltas: list[int] = field(default_factory=list)
    changed_elements: int = 0
    applied_elements: int = 0    # elements written here (a TP rank writes its share)
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    apply_seconds: float = 0.0   # parse + host-side preparation + pause
    pause_seconds: float = 0.0   # host->device copy + scatter (+ verification) of the weights
    total_seconds: float = 0.0
    recovered: str | None = None


class TensorReceiver:
    """Applies anchors and deltas to named tensors, keeping their digests."""

    verifies_digests = True

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self.names = [n for n, _ in named]
        self.tensors = dict(named)
        self.digests: dict[str, int] = {}

    def load_anchor(self, tensors: dict[str, torch.Tensor], label: str) -> None:
        for name, t in tensors.items():
            target = self.tensors.get(name)
            if target is None:
                raise ValueError(f"{label}: tensor {name} is not in this model")
            if target.dtype != t.dtype or tuple(target.shape) != tuple(t.shape):
                raise ValueError(f"{label}: tensor {name} is {t.dtype}{list(t.shape)}, the model's is "
                                 f"{target.dtype}{list(target.shape)}")
            target.copy_(t)
        loaded = [self.tensors[n] for n in tensors]
        if loaded:
            digests = ops.digest(loaded).tolist()
            self.digests.update({n: d & MASK for n, d in zip(tensors, digests)})

    def recompute_digests(self) -> None:
        digests = ops.digest(list(self.tensors.values())).tolist()
        self.digests = {n: d & MASK for n, d in zip(self.tensors, digests)}

    def parse_delta(self, data: bytes, label: str) -> ParsedDelta:
        """Reads a delta (either layout) against these tensors. A compact delta's values are
        relative to the base bits: the C++ decoder reads them directly from CPU tensors; for
        GPU tensors the delta comes back relative and apply_delta gathers the base bits on the
        device (O(changed)) before rebasing."""
        tensors = list(self.tensors.values())
        on_cpu = all(t.device.type == "cpu" for t in tensors)
        return parse_delta(data, label, [(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()],
                           tensors if on_cpu else None)

    def check_anchor(self, expected: dict[str, int], label: str) -> None:
        for name, value in expected.items():
            if self.digests.get(name) != value:
                raise IntegrityError(f"{label}: tensor {name} does not hash to its recorded digest")

    def apply_delta(self, delta: ParsedDelta, label: str, report: UpdateReport) -> None:
        names = [n for n in self.names if n in delta.changed]
        for name in delta.changed:
            if name not in self.tensors:
                raise ValueError(f"{label}: tensor {name} is not in this model")
        if delta.base_digests is not None:
            for name, value in delta.base_digests.items():
                if self.digests.get(name) != value:
                    raise IntegrityError(f"{label}: delta {delta.version} expects base version {delta.base_version} "
                                         f"digest {value:016x} for tensor {name}, found "
                                         f"{self.digests.get(name, 0):016x}")
        if not names:
            return
        targets = [self.tensors[n] for n in names]
        for n, t in zip(names, targets):
            if delta.changed[n][1].dtype != t.dtype:
                raise ValueError(f"{label}: tensor {n}: delta values are {delta.changed[n][1].dtype}, "
                                 f"the model's tensor is {t.dtype}")
        indices = torch.cat([delta.changed[n][0] for n in names])
        values = torch.cat([delta.changed[n][1].reshape(-1).view(torch.uint8) for n in names])
        counts = torch.tensor([delta.changed[n][0].numel() for n in names], dtype=torch.int64)
        device = targets[0].device
        started = time.perf_counter()
        d_indices = to_device(indices, device)
        # Old bits of the elements about to change: what the result check and a rollback need
        # (and, for a relative compact delta, the base its values are coded against).
        old = []
        for n, t, idx in zip(names, targets, torch.split(d_indices, counts.tolist())):
            in_range = idx[(idx >= 0) & (idx < t.numel())]
            old.append(int_view(t).index_select(0, in_range).view(torch.uint8))
        old_bytes = torch.cat(old)
        widths = [t.element_size() for t in targets]
        if delta.relative:
            values = rebase_values(values, old_bytes, counts.tolist(), widths)
        d_values = to_device(values, device)
        ops.apply(targets, d_indices, d_values, counts, names)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        report.pause_seconds += time.perf_counter() - started
        report.changed_elements += indices.numel()
        report.applied_elements += indices.numel()
        if delta.result_digests is None:
            return
        shifts = ops.digest_shift(indices, old_bytes.cpu(), values, counts, widths).tolist()
        updated = {n: (self.digests.get(n, 0) + s) & MASK for n, s in zip(names, shifts)}
        bad = [n for n in names if delta.result_digests.get(n) != updated[n]]
        if bad:
            ops.apply(targets, d_indices, old_bytes, counts, names)  # roll back: bit-for-bit as before
            raise IntegrityError(f"{label}: delta {delta.version} result digest mismatch for tensor {bad[0]}")
        self.digests.update(updated)


class DeltaSubscriber:
    def __init__(self, model, store, receiver: TensorReceiver | None = None, log=None):
        self.store = open_store(store)
        self.catalog = Catalog(self.store)
        self.receiver = receiver if receiver is not None else TensorReceiver(named_tensors(model))
        self.version: int | None = None
        self.last_report: UpdateReport | None = None
        self.reports: list[UpdateReport] = []
        self._log = log

    def poll(self) -> int | None:
        """The newest visible version (None: nothing published yet)."""
        return self.catalog.newest()

    @torch.no_grad()
    def update(self, version: int | None = None, audit: bool = False) -> int:
        """Brings the tensors to `version` (default: the newest) in place; returns the version.

        Digests are tracked in O(changed) per delta; audit=True first recomputes them from the
        weights (one read) and compares with the current version's manifest, so that writes into
        the weights from elsewhere are found (and repaired from an anchor)."""
        target = self.poll() if version is None else version
        if target is None:
            raise RuntimeError(f"{self.store.url}: the store has no published versions")
        if self.catalog.find(target) is None:
            raise RuntimeError(f"{self.store.url}: version {target} does not exist")
        report = UpdateReport(from_version=self.version, to_version=target)
        started = time.perf_counter()
        if target != self.version or audit:
            try:
                if audit and self.version is not None:
                    self._audit()
                self._execute(self.version, target, report)
            except IntegrityError as e:
                # The weights no longer match the chain (or a delta is bad): rebuild from an anchor.
                report.recovered = str(e)
                if self._log:
                    self._log(f"recovering from an anchor: {e}")
                self.version = None
                self._execute(None, target, report)
        report.total_seconds = time.perf_counter() - started
        self.last_report = report
        self.reports.append(report)
        return self.version

    def _audit(self) -> None:
        m = self.catalog.find(self.version)
        if m is None or not self.receiver.verifies_digests:
            return
        self.receiver.recompute_digests()
        for name, text in m.digests.items():
            if name in self.receiver.digests and f"{self.receiver.digests[name]:016x}" != text:
                raise IntegrityError(f"local weights do not match version {self.version}: tensor {name}")

    def _execute(self, current: int | None, target: int, report: UpdateReport) -> None:
        anchor, deltas = self.catalog.plan(current, target)
        if anchor is not None:
            m = self.catalog.find(anchor)
            self.version = None
            self._load_anchor(m, report)
            self.version = anchor
            report.anchor = anchor
        for v in deltas:
            m = self.catalog.find(v)
            t0 = time.perf_counter()
            data = fetch_verified(self.store, m.delta)
            report.fetch_seconds += time.perf_counter() - t0
            report.bytes_fetched += len(data)
            t1 = time.perf_counter()
            label = self.store.describe(m.delta.key)
            parsed = self.receiver.parse_delta(data, label)
            if parsed.version != m.version or parsed.base_version != m.base_version:
                raise IntegrityError(f"{label}: delta's versions disagree with its manifest")
            if parsed.base_version != self.version:
                raise IntegrityError(f"{label}: delta {v} expects base version {parsed.base_version}, "
                                     f"found version {self.version}")
            self.receiver.apply_delta(parsed, label, report)
            self.version = v
            report.deltas.append(v)
            report.apply_seconds += time.perf_counter() - t1

    def _load_anchor(self, m: Manifest, report: UpdateReport) -> None:
        for ref in m.anchor_parts:
            t0 = time.perf_counter()
            data = fetch_verified(self.store, ref)
            report.fetch_seconds += time.perf_counter() - t0
            report.bytes_fetched += len(data)
            t1 = time.perf_counter()
            label = self.store.describe(ref.key)
            tensors, digests, version = parse_anchor_part(data, label)
            if version != m.version:
                raise ValueError(f"{label}: anchor part of version {version}, manifest says {m.version}")
            self.receiver.load_anchor(tensors, label)
            if digests is not None and self.receiver.verifies_digests:
                self.receiver.check_anchor(digests, label)
            report.apply_seconds += time.perf_counter() - t1
