"""deltasync's store protocol for the Python package, from the C++ library
(host/include/deltasync/protocol.hpp) through torch.ops.deltasync.protocol_* and the
torch.classes.deltasync.Catalog class: object keys and nonces, manifest JSON (built, validated
and parsed in C++), the commit (manifest by exclusive create, then LATEST), verified fetches,
catch-up planning and retention. Versions written here are therefore the C++ publisher's
format byte for byte, and the C++ subscriber / CLI reads them (TRL-layout deltas; see
docs/torch.md).

What stays in Python: the Manifest dataclass (fields named as in protocol.hpp) that the publisher
fills and the subscriber reads, and SHA-256 of the objects the publisher writes (hashlib).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

from ._store import NativeStore, NotFound, _ops

DIGEST_ALGORITHM = "sum-mix64-v1"  # integrity.hpp kDigestAlgorithm (the name written into files)


def new_nonce() -> str:
    return _ops().protocol_new_nonce()


def delta_key(version: int, nonce: str) -> str:
    return _ops().protocol_delta_key(version, nonce)


def anchor_part_key(version: int, nonce: str, part: int) -> str:
    return _ops().protocol_anchor_part_key(version, nonce, part)


@dataclass
class ObjectRef:
    key: str
    size: int
    sha256: str

    @staticmethod
    def of(key: str, data: bytes) -> "ObjectRef":
        return ObjectRef(key, len(data), hashlib.sha256(data).hexdigest())


@dataclass
class Manifest:
    version: int
    delta: ObjectRef | None = None
    base_version: int | None = None
    delta_format: str = ""
    changed_elements: int = 0
    anchor_parts: list[ObjectRef] = field(default_factory=list)
    latest_anchor: int | None = None
    total_elements: int = 0
    model_bytes: int = 0
    digest_algorithm: str = DIGEST_ALGORITHM
    digests: dict[str, str] = field(default_factory=dict)
    created_unix_ms: int = 0

    def to_json(self) -> str:
        """The manifest's text as the C++ library writes it (and validates it: a manifest the
        C++ reader would refuse raises RuntimeError here)."""
        d = self.delta
        return _ops().protocol_manifest_json(
            self.version, self.base_version, d.key if d else None, d.size if d else 0, d.sha256 if d else "",
            self.delta_format, self.changed_elements,
            [p.key for p in self.anchor_parts], [p.size for p in self.anchor_parts],
            [p.sha256 for p in self.anchor_parts], self.latest_anchor, self.total_elements, self.model_bytes,
            self.digest_algorithm, list(self.digests), list(self.digests.values()),
            self.created_unix_ms or int(time.time() * 1000))

    @staticmethod
    def _from_native(text: str) -> "Manifest":
        """Reads the fields of a manifest the C++ parser has already accepted (Catalog.find)."""
        j = json.loads(text)
        ref = lambda o: None if o is None else ObjectRef(o["key"], o["size"], o["sha256"])  # noqa: E731
        return Manifest(
            version=j["version"], delta=ref(j["delta"]), base_version=j["base_version"],
            delta_format=j["delta_format"], changed_elements=j["changed_elements"],
            anchor_parts=[ref(p) for p in j["anchor_parts"]], latest_anchor=j["latest_anchor"],
            total_elements=j["total_elements"], model_bytes=j["model_bytes"],
            digest_algorithm=j["digest_algorithm"], digests=j["digests"], created_unix_ms=j["created_unix_ms"])


def commit_version(store: NativeStore, manifest: Manifest) -> bool:
    """Makes a version visible: manifest by exclusive create, then LATEST if it moves forward.
    False when the version already exists."""
    return bool(_ops().protocol_commit_version(store.url, manifest.to_json()))


def fetch_verified(store: NativeStore, ref: ObjectRef) -> bytes:
    """An object's bytes, checked (in C++) against the size and SHA-256 its manifest records.
    A mismatch (corrupt or replaced object) raises ValueError; a missing object NotFound."""
    try:
        return _ops().protocol_fetch_verified(store.url, ref.key, ref.size, ref.sha256).numpy().tobytes()
    except RuntimeError as e:
        if "differs from the manifest" in str(e):
            raise ValueError(str(e)) from None
        if "no such object" in str(e):
            raise NotFound(f"{store.describe(ref.key)}: no such object") from None
        raise


def apply_retention(store: NativeStore, keep_anchors: int) -> list[int]:
    """Keeps the newest `keep_anchors` anchors and the versions after the oldest of them;
    deletes the rest (stores that can list). Returns the deleted versions."""
    return list(_ops().protocol_apply_retention(store.url, keep_anchors))


class Catalog:
    """protocol::Catalog: manifests are immutable, so each is fetched (and parsed) once."""

    def __init__(self, store: NativeStore):
        import torch

        _ops()
        self.store = store
        self._native = torch.classes.deltasync.Catalog(store.url)
        self._cache: dict[int, Manifest] = {}

    def find(self, version: int) -> Manifest | None:
        if version not in self._cache:
            text = self._native.find(version)
            if not text:
                return None
            self._cache[version] = Manifest._from_native(text)
        return self._cache[version]

    def newest(self) -> int | None:
        v = self._native.newest()
        return None if v < 0 else v

    def plan(self, current: int | None, target: int, allow_current: bool = True) -> tuple[int | None, list[int]]:
        """The cheapest way (by bytes) to reach `target`: (anchor version or None, delta versions
        to apply in order)."""
        found, anchor, deltas, _ = self._native.plan(current, target, allow_current)
        if not found:
            raise ValueError(f"{self.store.url}: no way to reach version {target} from "
                             f"{'nothing' if current is None else f'version {current}'} (no anchor on its chain)")
        return (None if anchor < 0 else anchor), list(deltas)

    def forget(self, version: int) -> None:
        self._cache.pop(version, None)
        self._native.forget(version)
