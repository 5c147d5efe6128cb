"""Trainer side: DeltaPublisher hands a model's parameters to the C++ Publisher
(host/sync/publisher.hpp), which diffs them against a shadow of the last published bits where
they live (CPU twin or CUDA engine), stages the change set in host memory and returns; a
background thread writes the delta (and anchors) and commits the version to the store. When
uploads fall behind, staged deltas are folded into the newest one instead of waiting (a delta
coded on the GPU, or a low-memory one, cannot fold: publish() then waits for the oldest upload).
Everything here only passes tensors and options; defaults are the C++ PublisherOptions'.

    with deltasync.DeltaPublisher(model, store="file:///bucket", anchor_every=20) as pub:
        for step in ...:
            optimizer.step()
            pub.publish(step)          # returns once staged
    # leaving the block flushes: everything published is visible

format: "compact" (default; entropy-coded, values relative to the base bits; coded on the GPU
when the parameters are there), "trl" (interoperable NAME.indices + NAME.values; the default
in low-memory mode), or TRL's later layout "trl-idx" (NAME.idx + NAME.val, gap-coded indices) /
"trl-idx-raw" (raw indices); see docs/trl-formats.md.

Low-memory mode (low_memory=True, 2-byte dtypes): the shadow keeps only the low byte of each
element (1 byte instead of 2). A change that leaves an element's low byte unchanged is not seen;
to catch such misses every publish also hashes the full weights (one extra read), and the deltas
carry those as result digests: a tensor whose digest moved without a seen change makes the
version an anchor; otherwise a subscriber whose result does not match refuses the delta and
recovers from the next anchor.
"""
from __future__ import annotations

import inspect
from dataclasses import field, fields

import torch

from ._library import native
from ._params import named_tensors
from ._records import keyword_parameters, publisher_option_rows, record_class, version_stats_rows


def _sparsity(self) -> float:
    return 1.0 - self.changed_elements / self.total_elements if self.total_elements else 1.0


# One version as the publisher saw it: the fields of the C++ VersionStats (version_stats_fields()
# in host/sync/publisher.hpp), plus the model's total_elements.
PublishStats = record_class(
    "PublishStats", version_stats_rows(),
    "One version as the publisher saw it (a snapshot: read pub.stats again for later state).",
    extra=(("total_elements", int, field(default=0)),), namespace={"sparsity": property(_sparsity)},
    module=__name__)

_STAT_FIELDS = {f.name for f in fields(PublishStats)}
_OPTION_NAMES = [row[0] for row in publisher_option_rows()]


class LivePublishStats(PublishStats):
    """What publish() returns: its fields read the version's current state (staged, then visible
    with its sizes and upload times, or merged into a later version)."""

    def __init__(self, publisher: "DeltaPublisher", snapshot: PublishStats):
        self.__dict__.update(snapshot.__dict__)
        object.__setattr__(self, "_publisher", publisher)

    def __getattribute__(self, name):
        if name in _STAT_FIELDS and name not in ("version", "total_elements"):
            current = object.__getattribute__(self, "_publisher")._entry(object.__getattribute__(self, "version"))
            if current is not None:
                return current[name]
        return object.__getattribute__(self, name)


class DeltaPublisher:
    def __init__(self, model, store, *, low_memory: bool = False, log=None, resume: bool = False, **options):
        """The keywords are the C++ PublisherOptions' fields (publisher_option_fields(); None: the
        C++ default); the signature below lists them.

        resume=True continues the store where the last publisher left it (a restart after a
        crash, no local state needed): the newest visible version is pulled, verified, written
        into `model` and becomes the shadow (`resumed_version`; None for an empty store), so the
        next publish is a delta from it. Host-memory models only."""
        unknown = sorted(set(options) - set(_OPTION_NAMES))
        if unknown:
            raise TypeError(f"DeltaPublisher() got an unexpected keyword argument '{unknown[0]}'")
        if options.get("format") is None and low_memory:
            options["format"] = "trl"  # the compact layout needs the base bits, which the low-memory shadow lacks
        named = named_tensors(model)
        self.names = [n for n, _ in named]
        self.params = [t for _, t in named]
        self.device = self.params[0].device
        self.store = str(store)
        self._total = sum(t.numel() for t in self.params)
        self._native = native().Publisher(self.store, self.names, self.params, {**options, "low_memory": low_memory}, log)
        self.format = self._native.format
        self.low_memory = low_memory
        self._last_version: int | None = None
        self._hook = None
        self.resumed_version: int | None = None
        if resume:
            with torch.no_grad():
                self.resumed_version = self._native.resume()
            self._last_version = self.resumed_version

    @torch.no_grad()
    def publish(self, version: int, anchor: bool | None = None) -> PublishStats:
        """Diffs, stages in host memory and returns; the upload continues in the background.
        anchor=True also writes the full weights (None: every `anchor_every` versions)."""
        staged = self._native.publish(int(version), self.params, bool(anchor))
        self._last_version = int(version)
        return LivePublishStats(self, self._stats(staged))

    @property
    def stats(self) -> list[PublishStats]:
        """Every version published so far, in order."""
        return [self._stats(s) for s in self._native.history()]

    @property
    def last_report(self) -> PublishStats | None:
        history = self._native.history()
        return self._stats(history[-1]) if history else None

    def state(self) -> dict:
        """What is visible in the store: last_version, last_anchor_version, delta_bytes_since_anchor."""
        return self._native.state()

    @property
    def fence(self) -> dict:
        """The run and epoch this publisher claimed the store with: run_id, epoch, since (the
        version the epoch started from; None for an empty store). docs/stores.md, Fencing."""
        return self._native.fence

    @property
    def shadow_bytes(self) -> int:
        """Memory the shadow of the last published bits takes, where the parameters live."""
        return self._native.shadow_bytes

    def flush(self) -> None:
        """Returns once every version published so far is visible in the store."""
        self._native.flush()

    def close(self) -> None:
        try:
            self._native.close()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

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

    def _entry(self, version: int) -> dict | None:
        for d in reversed(self._native.history()):
            if d["version"] == version:
                return d
        return None

    def _stats(self, d: dict) -> PublishStats:
        return PublishStats(total_elements=self._total, **{k: v for k, v in d.items() if k in _STAT_FIELDS})


DeltaPublisher.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("self", "model", "store")]
    + [inspect.Parameter("low_memory", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool"),
       inspect.Parameter("log", inspect.Parameter.KEYWORD_ONLY, default=None),
       inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool")]
    + keyword_parameters(publisher_option_rows()))


def publisher_defaults() -> dict:
    """The C++ PublisherOptions' defaults (anchor_every, max_pending, anchor_part_bytes, ...),
    the same for the CLI and Python."""
    return native().publisher_defaults()
