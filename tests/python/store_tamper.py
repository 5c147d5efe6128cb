"""Rewriting a published delta in a folder store the way an attacker or a buggy writer would:
the delta's safetensors metadata is edited in place (tensor bytes and offsets untouched) and its
manifest entry (SHA-256, size, and optionally the manifest's own digests) is made to agree, so
that the fetch succeeds and the receiver's own checks are what must refuse it. A compact delta of
the indexed layout (compact_layout 2) keeps its digests in binary records: the record is edited
and its page hash, the header's compact_pages_sha256 and the manifest's hashes made to agree
(docs/compact-format.md, the indexed layout)."""
from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path


def _manifest_path(store_dir: Path, version: int) -> Path:
    return store_dir / "manifests" / f"{version:020d}.json"


def rewrite_delta(store_dir: Path, version: int, edit) -> None:
    """edit(header: dict, data: bytearray, manifest: dict) changes any of them in place (offsets
    and sizes kept)."""
    manifest_path = _manifest_path(store_dir, version)
    manifest = json.loads(manifest_path.read_text())
    delta_path = store_dir / manifest["delta"]["key"]
    raw = delta_path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    data = bytearray(raw[8 + header_len:])
    edit(header, data, manifest)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text + bytes(data)
    delta_path.write_bytes(new)
    manifest["delta"]["sha256"] = hashlib.sha256(new).hexdigest()
    if "header_sha256" in manifest["delta"]:  # sealed for ranged reads: the header's hash agrees too
        manifest["delta"]["header_sha256"] = hashlib.sha256(new[:8 + len(text)]).hexdigest()
    manifest["delta"]["size"] = len(new)
    manifest_path.write_text(json.dumps(manifest))


def _natural_key(name: str):
    """The tensor table's order (codec/compact_table.hpp): digit runs compare as numbers."""
    return [int(run) if run.isdigit() else run for run in re.split(r"(\d+)", name)]


def _bump_record_digest(header: dict, data: bytearray, manifest: dict, tensor: str, field: str) -> int:
    """Adds one to `tensor`'s base or result digest in its indexed record, its page hash and the
    header's hash of the page hashes made to agree; returns the new value."""
    names = sorted(manifest["digests"], key=_natural_key)  # a manifest's digests name every tensor
    ordinal = names.index(tensor)
    p0, _ = header["compact.present"]["data_offsets"]
    bitmap = data[p0:p0 + (len(names) + 7) // 8]
    assert bitmap[ordinal // 8] >> (ordinal % 8) & 1, f"{tensor} has no record"
    k = sum(bin(b).count("1") for b in bitmap[:ordinal // 8]) + bin(bitmap[ordinal // 8] & ((1 << (ordinal % 8)) - 1)).count("1")
    r0, r1 = header["compact.records"]["data_offsets"]
    at = r0 + 56 * k + {"base": 24, "result": 32}[field]
    value = (int.from_bytes(data[at:at + 8], "little") + 1) % (1 << 64)
    data[at:at + 8] = value.to_bytes(8, "little")
    page = k // 64
    begin = r0 + page * 64 * 56
    g0, g1 = header["compact.pages"]["data_offsets"]
    data[g0 + 16 * page:g0 + 16 * page + 16] = hashlib.sha256(data[begin:min(r1, begin + 64 * 56)]).digest()[:16]
    header["__metadata__"]["compact_pages_sha256"] = hashlib.sha256(data[g0:g1]).hexdigest()
    return value


def bump_digest(hex_digest: str) -> str:
    return f"{(int(hex_digest, 16) + 1) % (1 << 64):016x}"


def tamper_result_digest(store_dir: Path, version: int, tensor: str) -> None:
    """The delta (and its manifest) promise a result the delta does not produce."""
    def edit(header, data, manifest):
        md = header["__metadata__"]
        if md.get("compact_layout") == "2":
            promised = f"{_bump_record_digest(header, data, manifest, tensor, 'result'):016x}"
        else:
            result = json.loads(md["result_digests"])
            promised = result[tensor] = bump_digest(result[tensor])
            md["result_digests"] = json.dumps(result, separators=(",", ":"))
        if tensor in manifest.get("digests", {}):
            manifest["digests"][tensor] = promised
    rewrite_delta(store_dir, version, edit)


def tamper_base_digest(store_dir: Path, version: int, tensor: str) -> None:
    """The delta claims to be made for other base weights than the receiver holds."""
    def edit(header, data, manifest):
        md = header["__metadata__"]
        if md.get("compact_layout") == "2":
            _bump_record_digest(header, data, manifest, tensor, "base")
            return
        base = json.loads(md["base_digests"])
        base[tensor] = bump_digest(base[tensor])
        md["base_digests"] = json.dumps(base, separators=(",", ":"))
    rewrite_delta(store_dir, version, edit)


def tamper_anchor_tensor(store_dir: Path, version: int, tensor: str) -> None:
    """One bit of `tensor` flipped in the anchor part of `version` that holds it, the manifest's
    SHA-256 of that part made to agree: the fetch succeeds, the anchor's verification must fail."""
    manifest_path = _manifest_path(store_dir, version)
    manifest = json.loads(manifest_path.read_text())
    for part in manifest["anchor_parts"]:
        path = store_dir / part["key"]
        raw = bytearray(path.read_bytes())
        (header_len,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + header_len])
        if tensor not in header:
            continue
        raw[8 + header_len + header[tensor]["data_offsets"][0]] ^= 1
        path.write_bytes(bytes(raw))
        part["sha256"] = hashlib.sha256(raw).hexdigest()
        manifest_path.write_text(json.dumps(manifest))
        return
    raise KeyError(f"{tensor} is in no anchor part of version {version}")
