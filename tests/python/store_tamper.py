"""Rewriting a published delta in a folder store the way an attacker or a buggy writer would:
the delta's safetensors metadata is edited in place (tensor bytes and offsets untouched) and its
manifest entry (SHA-256, size, and optionally the manifest's own digests) is made to agree, so
that the fetch succeeds and the receiver's own checks are what must refuse it."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path


def _manifest_path(store_dir: Path, version: int) -> Path:
    return store_dir / "manifests" / f"{version:020d}.json"


def rewrite_delta(store_dir: Path, version: int, edit) -> None:
    """edit(metadata: dict[str, str], manifest: dict) changes either in place."""
    manifest_path = _manifest_path(store_dir, version)
    manifest = json.loads(manifest_path.read_text())
    delta_path = store_dir / manifest["delta"]["key"]
    raw = delta_path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    edit(header["__metadata__"], manifest)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text + raw[8 + header_len:]
    delta_path.write_bytes(new)
    manifest["delta"]["sha256"] = hashlib.sha256(new).hexdigest()
    if "header_sha256" in manifest["delta"]:  # sealed for ranged reads: the header's hash agrees too
        manifest["delta"]["header_sha256"] = hashlib.sha256(new[:8 + len(text)]).hexdigest()
    manifest["delta"]["size"] = len(new)
    manifest_path.write_text(json.dumps(manifest))


def bump_digest(hex_digest: str) -> str:
    return f"{(int(hex_digest, 16) + 1) % (1 << 64):016x}"


def tamper_result_digest(store_dir: Path, version: int, tensor: str) -> None:
    """The delta (and its manifest) promise a result the delta does not produce."""
    def edit(md, manifest):
        result = json.loads(md["result_digests"])
        result[tensor] = bump_digest(result[tensor])
        md["result_digests"] = json.dumps(result, separators=(",", ":"))
        if tensor in manifest.get("digests", {}):
            manifest["digests"][tensor] = result[tensor]
    rewrite_delta(store_dir, version, edit)


def tamper_base_digest(store_dir: Path, version: int, tensor: str) -> None:
    """The delta claims to be made for other base weights than the receiver holds."""
    def edit(md, manifest):
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
