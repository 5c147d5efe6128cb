"""Trainer side: DeltaPublisher diffs the model against a shadow of the last published bits
(kept on the parameters' device), stages the changes in host memory and returns; a background
thread computes digests, writes the delta (and every `anchor_every` versions an anchor) and
commits the version to the store (deltasync's store protocol, from the C++ library; see
_protocol.py). Delta and anchor files are written by the C++ library (_files.py): format=
"compact" (default; entropy-coded, values relative to the base bits) or "trl" (interoperable
NAME.indices + NAME.values; the default in low-memory mode, which keeps no base bits). With keep_anchors=K, retention then deletes what the newest K anchors no longer need.

When uploads fall behind (max_pending staged versions waiting), publish() does not wait: it folds
the newest staged delta that has not started uploading into the new one (one delta from that
version's base to the new weights; the skipped version never appears in the store, its stats say
merged_into). Only when that cannot be done -- an anchor, low-memory deltas (no base bits), or
an upload already running -- does it wait for the oldest upload.

    with deltasync.DeltaPublisher(model, store="file:///bucket", anchor_every=20) as pub:
        for step in ...:
            optimizer.step()
            pub.publish(step)          # returns once staged
    # leaving the block flushes: everything published is visible

Low-memory mode (low_memory=True, 2-byte dtypes): the shadow keeps only the low byte of each
element (1 byte instead of 2). A change that leaves an element's low byte unchanged (its high
byte -- sign and upper exponent bits -- moves while the low byte happens to end equal) is not
seen and not shipped. To catch such misses every publish then computes full digests of the
weights (one extra read), which the deltas carry as result digests: a subscriber whose result
does not match refuses the delta and recovers from the next anchor.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import ops
from ._files import FORMATS, merge_deltas, serialize_anchor_part, serialize_delta
from ._params import flat_bytes, int_view, named_tensors, to_host
from ._protocol import (DIGEST_ALGORITHM, Manifest, ObjectRef, anchor_part_key, apply_retention, commit_version,
                        delta_key, new_nonce)
from ._store import open_store

MASK = (1 << 64) - 1


@dataclass
class PublishStats:
    version: int
    anchor: bool = False
    changed_elements: int = 0
    total_elements: int = 0
    delta_bytes: int = 0
    anchor_bytes: int = 0
    stage_seconds: float = 0.0   # inside publish(): diff + copy to host
    upload_seconds: float = 0.0  # background: digests, serialization, store writes
    visible_seconds: float = 0.0  # publish() call to version visible (merged: the oldest merged version's call)
    skipped: bool = False  # not uploaded: an earlier upload had failed
    merged_versions: int = 1  # > 1: this version's delta also carries earlier, never-uploaded ones
    merged_into: int | None = None  # not uploaded on its own: merged into this later version
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.changed_elements / self.total_elements if self.total_elements else 1.0


@dataclass
class _Job:
    stats: PublishStats
    base_version: int | None
    started: float
    # delta (host tensors, encode layout)
    indices: torch.Tensor | None = None
    values: torch.Tensor | None = None
    base_values: torch.Tensor | None = None
    counts: list[int] | None = None
    full_digests: list[int] | None = None   # low-memory mode: computed at publish time
    anchor: list[torch.Tensor] | None = None  # host copies of the full weights
    ready: torch.cuda.Event | None = None    # host copies complete


class DeltaPublisher:
    def __init__(self, model, store, anchor_every: int = 20, format: str | None = None, low_memory: bool = False,
                 anchor_part_bytes: int = 2 << 30, max_pending: int = 4, log=None, keep_anchors: int = 0):
        if format is None:  # the compact layout needs the base bits, which the low-memory shadow lacks
            format = "trl" if low_memory else "compact"
        if format not in FORMATS:
            raise ValueError(f"deltasync.DeltaPublisher: format {format!r}: choose 'trl' (interoperable) or 'compact'")
        if format == "compact" and low_memory:
            raise ValueError("deltasync.DeltaPublisher: format='compact' codes values relative to the base bits, "
                             "which the low-memory shadow does not keep; use format='trl' with low_memory=True")
        self.format = format
        self._named = named_tensors(model)
        self.names = [n for n, _ in self._named]
        self.params = [t for _, t in self._named]
        self.device = self.params[0].device
        self.store = open_store(store)
        self.anchor_every = anchor_every
        self.low_memory = low_memory
        if low_memory and any(t.element_size() != 2 for t in self.params):
            raise ValueError("deltasync.DeltaPublisher: low_memory needs 2-byte dtypes (bfloat16/float16)")
        self.anchor_part_bytes = anchor_part_bytes
        # Retention after each anchor: keep the newest `keep_anchors` anchors and what follows
        # them (0: keep everything). Stores that cannot list (http) skip it.
        self.keep_anchors = keep_anchors
        self._meta = [(n, t.dtype, tuple(t.shape)) for n, t in self._named]
        self._widths = [t.element_size() for t in self.params]
        self._total = sum(t.numel() for t in self.params)
        self._model_bytes = sum(t.numel() * t.element_size() for t in self.params)
        self._shadow: list[torch.Tensor] | None = None
        self._last_version: int | None = None
        self._last_anchor: int | None = None
        self._since_anchor = 0
        self._digests: list[int] | None = None  # at the last uploaded version (worker thread)
        self._published_digests: list[int] | None = None  # low-memory mode: at the last publish
        self._chain_broken = False  # set by the worker when an upload failed
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-publish")
        self._pending: list[tuple[Future, _Job]] = []  # submitted uploads, oldest first
        self._max_pending = max_pending
        self._failure: BaseException | None = None
        self._log = log
        self.stats: list[PublishStats] = []
        self._hook = None

    # ---- public API ---------------------------------------------------------------------------

    @torch.no_grad()
    def publish(self, version: int, anchor: bool | None = None) -> PublishStats:
        """Diffs, stages in host memory and returns; the upload continues in the background.
        anchor=True also writes the full weights (None: every `anchor_every` versions)."""
        self._raise_failure()
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"deltasync.DeltaPublisher: version {version} is not newer than {self._last_version}")
        started = time.perf_counter()
        stats = PublishStats(version=version, total_elements=self._total)
        if anchor is None:
            anchor = self.anchor_every > 0 and self._since_anchor + 1 >= self.anchor_every
        anchor = anchor or self._shadow is None
        job = _Job(stats=stats, base_version=self._last_version, started=started)
        restart = self._chain_broken  # an earlier upload failed: its version is missing from the store
        if restart:
            anchor = True
            job.base_version = None
        if self._shadow is None:
            self._shadow = [self._new_shadow(t) for t in self.params]
        else:
            self._stage_delta(job)
            if restart:  # the shadow is now current; this version restarts the chain as an anchor
                job.indices = job.values = job.base_values = job.counts = None
        if self.low_memory and job.indices is not None:
            job.full_digests = ops.digest(self.params).tolist()
            # A tensor whose digest moved although no change of it was seen lost a change to
            # the low-byte shadow: the receiver would not check it, so this version becomes an
            # anchor without a delta (subscribers must load it).
            missed = [n for n, c, old, new in zip(self.names, job.counts, self._published_digests, job.full_digests)
                      if c == 0 and old != new]
            if missed:
                if self._log:
                    self._log(f"v{version}: low-memory shadow missed a change in {missed[0]}; publishing an anchor")
                job.indices = job.values = job.base_values = job.counts = None
                anchor = True
            self._published_digests = job.full_digests
        if anchor:
            job.anchor = [to_host(t) for t in self.params]
            self._since_anchor = 0
            if self.low_memory and job.full_digests is None:
                self._published_digests = ops.digest(self.params).tolist()
        else:
            self._since_anchor += 1
        if self.device.type == "cuda":
            job.ready = torch.cuda.Event()
            job.ready.record()
            job.ready.synchronize()
        stats.anchor = job.anchor is not None
        stats.stage_seconds = time.perf_counter() - started
        self._last_version = version
        self.stats.append(stats)
        self._pending = [(f, j) for f, j in self._pending if not f.done()]
        if len(self._pending) >= self._max_pending and self._merge_into_last_pending(job):
            return stats
        while len(self._pending) >= self._max_pending:  # bounded host memory when the store is slow
            self._pending.pop(0)[0].exception()  # a failure is reported by the next publish / flush
        self._pending.append((self._executor.submit(self._upload, job), job))
        return stats

    def _merge_into_last_pending(self, job: _Job) -> bool:
        """Uploads fell behind: folds the newest queued, not yet started delta into `job` (one
        delta from that version's base to this one's result), instead of waiting. Only plain
        deltas merge (an anchor, or the low-memory mode's deltas without base bits, do not)."""
        future, last = self._pending[-1]
        mergeable = (job.indices is not None and job.anchor is None and job.base_values is not None
                     and last.indices is not None and last.anchor is None and last.base_values is not None)
        if not mergeable or not future.cancel():  # cancel() fails once the worker has started it
            return False
        try:
            merged = merge_deltas(self._meta, (last.indices, last.values, last.base_values, last.counts),
                                  (job.indices, job.values, job.base_values, job.counts))
        except BaseException as e:
            # `last` must still be uploaded (later versions chain on it): queue it again, in its
            # place. An ordinary error then falls back to waiting (both versions are uploaded as
            # they are); raising instead would lose `job`, whose changes the shadow already holds.
            self._pending[-1] = (self._executor.submit(self._upload, last), last)
            if not isinstance(e, Exception):
                raise
            if self._log:
                self._log(f"v{job.stats.version}: merging v{last.stats.version} failed ({e}); waiting for uploads")
            return False
        job.indices, job.values, job.base_values, job.counts = merged
        # The cancelled work item stays in the executor's queue until the worker reaches it, and
        # it holds `last`: drop its staged delta now, or every merge while uploads stall would
        # keep one more delta in host memory (max_pending bounds what is queued, merged or not).
        last.indices = last.values = last.base_values = last.counts = None
        job.base_version = last.base_version
        job.stats.changed_elements = int(sum(job.counts))
        job.stats.merged_versions = last.stats.merged_versions + 1
        job.started = last.started
        last.stats.merged_into = job.stats.version
        last.stats.done.set()
        self._pending[-1] = (self._executor.submit(self._upload, job), job)
        if self._log:
            self._log(f"v{last.stats.version} merged into v{job.stats.version} (uploads behind)")
        return True

    def flush(self) -> None:
        """Returns once every version published so far is visible in the store."""
        for f, _ in self._pending:
            f.exception()
        self._pending.clear()
        self._raise_failure()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._hook is not None:
                self._hook.remove()
            self._executor.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:  # don't mask the original error
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass

    def attach(self, optimizer: torch.optim.Optimizer, first_version: int | None = None):
        """Publishes after every optimizer.step() (versions counting up from first_version,
        default: last published + 1, or 1). Returns the hook handle."""
        counter = {"next": first_version}

        def hook(opt, args, kwargs):
            v = counter["next"]
            if v is None:
                v = 1 if self._last_version is None else self._last_version + 1
            self.publish(v)
            counter["next"] = v + 1

        self._hook = optimizer.register_step_post_hook(hook)
        return self._hook

    # ---- staging (caller thread) ------------------------------------------------------------------

    def _new_shadow(self, t: torch.Tensor) -> torch.Tensor:
        if self.low_memory:
            return flat_bytes(t).view(-1, 2)[:, 0].clone()  # little-endian: byte 0 is the low byte
        return t.clone()

    def _stage_delta(self, job: _Job) -> None:
        if self.low_memory:
            indices, values, counts = self._encode_low_byte()
            base_values = None
        else:
            indices, values, base_values, counts = ops.encode_with_base(self.params, self._shadow, self.names)
        job.indices = to_host(indices)
        job.values = to_host(values)
        job.base_values = None if base_values is None else to_host(base_values)
        job.counts = counts.tolist()
        job.stats.changed_elements = int(sum(job.counts))

    def _encode_low_byte(self):
        indices, values, counts = [], [], []
        for t, low in zip(self.params, self._shadow):
            current_low = flat_bytes(t).view(-1, 2)[:, 0]
            changed = torch.ne(current_low, low).nonzero().reshape(-1)
            low.index_copy_(0, changed, current_low.index_select(0, changed))
            indices.append(changed)
            values.append(int_view(t).index_select(0, changed).view(torch.uint8))
            counts.append(changed.numel())
        return torch.cat(indices), torch.cat(values), torch.tensor(counts)

    # ---- upload (worker thread) -------------------------------------------------------------------

    def _upload(self, job: _Job) -> None:
        try:
            if self._chain_broken and job.indices is not None:
                # Its base version never became visible; publish() turns the next version into
                # an anchor. Not reported again: the failure that broke the chain already is.
                job.stats.skipped = True
                return
            self._upload_unchecked(job)
            if job.indices is None:
                self._chain_broken = False
        except BaseException as e:  # noqa: BLE001  (reported by the next publish/flush)
            self._chain_broken = True
            if self._failure is None:
                self._failure = e
            raise
        finally:
            job.stats.done.set()

    def _upload_unchecked(self, job: _Job) -> None:
        t0 = time.perf_counter()
        stats = job.stats
        delta_bytes = None
        base_digests = self._digests
        if job.indices is not None:
            if job.full_digests is not None:
                result = [d & MASK for d in job.full_digests]
            else:
                shifts = ops.digest_shift(job.indices, job.base_values, job.values, torch.tensor(job.counts),
                                          self._widths).tolist()
                result = [(d + s) & MASK for d, s in zip(base_digests, shifts)]
            # Digests of every tensor; the C++ writer records those of the changed ones.
            delta_bytes = serialize_delta(self.format, self._meta, job.indices, job.values, job.base_values,
                                          job.counts, stats.version, job.base_version, base_digests, result)
        else:
            result = job.full_digests
        parts = []
        if job.anchor is not None:
            full = ops.digest(job.anchor).tolist()
            if job.indices is not None and [d & MASK for d in full] != result:
                raise RuntimeError(f"deltasync.DeltaPublisher: version {stats.version}: the anchor's weights disagree "
                                   "with the delta chain's digests (low-memory mode missed a change?)")
            result = [d & MASK for d in full]
            parts = self._anchor_parts(job.anchor, stats.version, result)
        nonce = new_nonce()
        m = Manifest(version=stats.version, total_elements=self._total, model_bytes=self._model_bytes,
                     digest_algorithm=DIGEST_ALGORITHM)
        if delta_bytes is not None:
            key = delta_key(stats.version, nonce)
            self.store.put(key, delta_bytes)
            m.delta = ObjectRef.of(key, delta_bytes)  # (an anchor-only version has no base_version)
            m.base_version = job.base_version
            m.delta_format = self.format
            m.changed_elements = stats.changed_elements
            stats.delta_bytes = len(delta_bytes)
        for k, data in enumerate(parts):
            key = anchor_part_key(stats.version, nonce, k)
            self.store.put(key, data)
            m.anchor_parts.append(ObjectRef.of(key, data))
            stats.anchor_bytes += len(data)
        if parts:
            self._last_anchor = stats.version
        m.latest_anchor = self._last_anchor
        m.digests = {n: f"{result[t] & MASK:016x}" for t, n in enumerate(self.names)}
        if not commit_version(self.store, m):
            raise RuntimeError(f"{self.store.describe('manifests')}: version {stats.version} already exists")
        self._digests = [d & MASK for d in result]
        if parts and self.keep_anchors:
            self._apply_retention()
        stats.upload_seconds = time.perf_counter() - t0
        stats.visible_seconds = time.perf_counter() - job.started
        if self._log:
            self._log(f"published v{stats.version}: {'anchor ' if parts else ''}{stats.changed_elements} changed, "
                      f"{stats.delta_bytes + stats.anchor_bytes} bytes")

    def _apply_retention(self) -> None:
        try:
            deleted = apply_retention(self.store, self.keep_anchors)
        except RuntimeError as e:
            if "listing is not supported" in str(e):
                self.keep_anchors = 0  # this store cannot list: retention is skipped from now on
            elif self._failure is None:
                # Reported by the next publish / flush, but the version is already visible, so
                # the chain is intact (raising here would make the next version an anchor).
                self._failure = e
            return
        if deleted and self._log:
            self._log(f"retention: deleted versions {deleted[0]}..{deleted[-1]} ({len(deleted)})")

    def _anchor_parts(self, weights: list[torch.Tensor], version: int, digests: list[int]) -> list[bytes]:
        groups, size = [[]], 0
        for t, w in enumerate(weights):
            n = w.numel() * w.element_size()
            if groups[-1] and size + n > self.anchor_part_bytes:
                groups.append([])
                size = 0
            groups[-1].append(t)
            size += n
        return [serialize_anchor_part([self._meta[t] for t in g], [weights[t] for t in g], version, k, len(groups),
                                      [digests[t] for t in g]) for k, g in enumerate(groups)]

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError(f"deltasync.DeltaPublisher: background upload failed: {failure}") from failure
