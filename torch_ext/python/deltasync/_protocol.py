"""The store protocol of deltasync (host/include/deltasync/protocol.hpp) in Python: the same
object keys, manifest JSON and LATEST pointer, so versions written here are read by the C++
subscriber / CLI and the other way round (TRL-layout deltas; see docs/torch.md).

Layout: deltas/V-NONCE.safetensors, anchors/V-NONCE/part-00000.safetensors, manifests/V.json
(exclusive create, written after its objects), LATEST ("V\\n", only moves forward).
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field

from ._store import FolderStore, NotFound

LATEST_KEY = "LATEST"
MANIFEST_PREFIX = "manifests/"
MANIFEST_FORMAT = 1
DIGEST_ALGORITHM = "sum-mix64-v1"


def manifest_key(version: int) -> str:
    return f"{MANIFEST_PREFIX}{version:020d}.json"


def version_of_manifest_key(key: str) -> int | None:
    digits = key[len(MANIFEST_PREFIX):-5]
    if key.startswith(MANIFEST_PREFIX) and key.endswith(".json") and len(digits) == 20 and digits.isdigit():
        return int(digits)
    return None


def new_nonce() -> str:
    return secrets.token_hex(6)


def delta_key(version: int, nonce: str) -> str:
    return f"deltas/{version:020d}-{nonce}.safetensors"


def anchor_part_key(version: int, nonce: str, part: int) -> str:
    return f"anchors/{version:020d}-{nonce}/part-{part:05d}.safetensors"


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

    @property
    def has_anchor(self) -> bool:
        return bool(self.anchor_parts)

    @property
    def kind(self) -> str:
        return ("anchor+delta" if self.delta else "anchor") if self.has_anchor else "delta"

    @property
    def anchor_bytes(self) -> int:
        return sum(p.size for p in self.anchor_parts)

    def to_json(self) -> str:
        obj = lambda o: None if o is None else {"key": o.key, "size": o.size, "sha256": o.sha256}  # noqa: E731
        return json.dumps(
            {
                "format": "deltasync-manifest",
                "format_version": MANIFEST_FORMAT,
                "version": self.version,
                "kind": self.kind,
                "base_version": self.base_version,
                "delta": obj(self.delta),
                "delta_format": self.delta_format,
                "changed_elements": self.changed_elements,
                "anchor_parts": [obj(p) for p in self.anchor_parts],
                "latest_anchor": self.latest_anchor,
                "total_elements": self.total_elements,
                "model_bytes": self.model_bytes,
                "digest_algorithm": self.digest_algorithm,
                "digests": self.digests,
                "created_unix_ms": self.created_unix_ms or int(time.time() * 1000),
            },
            indent=1,
        )

    @staticmethod
    def from_json(text: bytes | str, label: str) -> "Manifest":
        try:
            j = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{label}: manifest is not valid JSON ({e})") from None
        if not isinstance(j, dict) or j.get("format") != "deltasync-manifest":
            raise ValueError(f"{label}: not a deltasync manifest")
        if j.get("format_version") != MANIFEST_FORMAT:
            raise ValueError(f"{label}: manifest format_version {j.get('format_version')!r} is not supported")
        try:
            ref = lambda o: None if o is None else ObjectRef(str(o["key"]), int(o["size"]), str(o["sha256"]))  # noqa: E731
            m = Manifest(
                version=int(j["version"]),
                delta=ref(j["delta"]),
                base_version=j["base_version"],
                delta_format=j["delta_format"],
                changed_elements=int(j["changed_elements"]),
                anchor_parts=[ref(p) for p in j["anchor_parts"]],
                latest_anchor=j["latest_anchor"],
                total_elements=int(j["total_elements"]),
                model_bytes=int(j["model_bytes"]),
                digest_algorithm=j["digest_algorithm"],
                digests=dict(j["digests"]),
                created_unix_ms=int(j["created_unix_ms"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{label}: malformed manifest ({e!r})") from None
        if (m.delta is None) != (m.base_version is None):
            raise ValueError(f"{label}: manifest has a delta without base_version or the reverse")
        if m.delta is None and not m.anchor_parts:
            raise ValueError(f"{label}: manifest names neither a delta nor an anchor")
        return m


def commit_version(store: FolderStore, manifest: Manifest) -> bool:
    """Makes a version visible: manifest by exclusive create, then LATEST if it moves forward."""
    if not store.put_if_absent(manifest_key(manifest.version), manifest.to_json().encode()):
        return False
    latest = read_latest(store)
    if latest is None or latest < manifest.version:
        store.put(LATEST_KEY, f"{manifest.version}\n".encode())
    return True


def read_latest(store: FolderStore) -> int | None:
    try:
        text = store.get(LATEST_KEY).decode().strip()
    except NotFound:
        return None
    if not text.isdigit() or len(text) > 20:
        raise ValueError(f"{store.describe(LATEST_KEY)}: malformed LATEST pointer")
    return int(text)


def fetch_verified(store: FolderStore, ref: ObjectRef) -> bytes:
    """An object's bytes, checked against the size and SHA-256 its manifest records."""
    data = store.get(ref.key)
    if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ValueError(f"{store.describe(ref.key)}: size or sha256 differs from the manifest")
    return data


class Catalog:
    """Manifests are immutable: each is fetched at most once."""

    def __init__(self, store: FolderStore):
        self.store = store
        self._cache: dict[int, Manifest] = {}

    def find(self, version: int) -> Manifest | None:
        if version not in self._cache:
            key = manifest_key(version)
            try:
                data = self.store.get(key)
            except NotFound:
                return None
            self._cache[version] = Manifest.from_json(data, self.store.describe(key))
        return self._cache[version]

    def newest(self) -> int | None:
        latest = read_latest(self.store)
        if latest is not None and self.find(latest) is not None:
            listed = [v for v in map(version_of_manifest_key, self.store.list(MANIFEST_PREFIX)) if v is not None]
            return max([latest, *listed])
        listed = [v for v in map(version_of_manifest_key, self.store.list(MANIFEST_PREFIX)) if v is not None]
        return max(listed) if listed else None

    def plan(self, current: int | None, target: int) -> tuple[int | None, list[int]]:
        """The cheapest way (by bytes) to reach `target`: (anchor version or None, delta versions
        to apply in order). Follows base_version links back from the target until it meets the
        current version or an anchor."""
        chain: list[int] = []  # versions whose deltas are applied, newest first
        best: tuple[int, int | None, list[int]] | None = None  # (bytes, anchor, deltas)
        version, delta_bytes = target, 0
        while True:
            m = self.find(version)
            if m is None:
                break
            if current is not None and version == current:
                cost = delta_bytes
                if best is None or cost <= best[0]:
                    best = (cost, None, list(reversed(chain)))
                break
            if m.has_anchor:
                cost = m.anchor_bytes + delta_bytes
                if best is None or cost < best[0]:
                    best = (cost, version, list(reversed(chain)))
            if m.delta is None or m.base_version is None:
                break
            chain.append(version)
            delta_bytes += m.delta.size
            version = m.base_version
        if best is None:
            raise ValueError(f"{self.store.url}: no way to reach version {target} from "
                             f"{'nothing' if current is None else f'version {current}'} (no anchor on its chain)")
        return best[1], best[2]
