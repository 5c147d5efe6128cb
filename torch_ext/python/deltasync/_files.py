"""Delta and anchor files: safetensors in the interoperable (TRL) layout that deltasync's C++
reader (host/include/deltasync/delta_file.hpp, integrity.hpp) accepts.

Delta: NAME.indices (I32 ascending flat positions; I64 past 2^31-1 elements) + NAME.values
(the tensor's dtype) per changed tensor; metadata sparse="True", format="trl", model_version,
base_version, sparsity, changed_params, total_elements, total_changed_elements, tensor_shapes,
digest_algorithm, base_digests, result_digests (name -> 16 hex digits).
Anchor part: tensors whole; metadata sparse="False", format="anchor", model_version,
anchor_part "k/n", digest_algorithm, digests.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ._protocol import DIGEST_ALGORITHM

ST_DTYPE = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32",
}
TORCH_DTYPE = {v: k for k, v in ST_DTYPE.items()}
I32_LIMIT = 2**31 - 1


def hex_digest(value: int) -> str:
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"


def parse_hex_digest(text: str, label: str) -> int:
    if len(text) != 16 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"{label}: bad digest {text!r} (want 16 lowercase hex digits)")
    return int(text, 16)


def tensor_shapes(meta: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> str:
    return json.dumps({name: {"dtype": ST_DTYPE[dtype], "shape": list(shape)} for name, dtype, shape in meta},
                      separators=(",", ":"))


def serialize_delta(meta, changed: dict[str, tuple[torch.Tensor, torch.Tensor]], version: int, base_version: int,
                    base_digests: dict[str, int], result_digests: dict[str, int]) -> bytes:
    """`changed` maps a tensor name to (int64 positions, values in the tensor's dtype), CPU."""
    tensors = {}
    total = sum(_numel(shape) for _, _, shape in meta)
    changed_total = 0
    for name, dtype, shape in meta:
        if name not in changed:
            continue
        indices, values = changed[name]
        narrow = indices.to(torch.int32) if _numel(shape) <= I32_LIMIT else indices
        tensors[f"{name}.indices"] = narrow.contiguous()
        tensors[f"{name}.values"] = values.contiguous()
        changed_total += indices.numel()
    metadata = {
        "sparse": "True", "format": "trl",
        "model_version": str(version), "base_version": str(base_version),
        "sparsity": repr(1.0 - changed_total / total) if total else "1.0",
        "changed_params": json.dumps([n for n, _, _ in meta if n in changed]),
        "total_elements": str(total), "total_changed_elements": str(changed_total),
        "tensor_shapes": tensor_shapes(meta),
        "digest_algorithm": DIGEST_ALGORITHM,
        "base_digests": json.dumps({n: hex_digest(d) for n, d in sorted(base_digests.items())}),
        "result_digests": json.dumps({n: hex_digest(d) for n, d in sorted(result_digests.items())}),
    }
    return save_safetensors(tensors, metadata)


def serialize_anchor_part(tensors: dict[str, torch.Tensor], version: int, part: int, parts: int,
                          digests: dict[str, int]) -> bytes:
    metadata = {
        "sparse": "False", "format": "anchor", "model_version": str(version), "anchor_part": f"{part}/{parts}",
        "digest_algorithm": DIGEST_ALGORITHM,
        "digests": json.dumps({n: hex_digest(d) for n, d in sorted(digests.items())}),
    }
    return save_safetensors({n: t.contiguous() for n, t in tensors.items()}, metadata)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def read_metadata(data: bytes, label: str) -> dict[str, str]:
    if len(data) < 8:
        raise ValueError(f"{label}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise ValueError(f"{label}: header length {header_len} exceeds the file")
    try:
        header = json.loads(data[8:8 + header_len])
    except ValueError as e:
        raise ValueError(f"{label}: header is not JSON ({e})") from None
    return dict(header.get("__metadata__") or {})


@dataclass
class ParsedDelta:
    version: int
    base_version: int | None
    changed: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (int64 positions, values)
    base_digests: dict[str, int] | None
    result_digests: dict[str, int] | None


def parse_delta(data: bytes, label: str) -> ParsedDelta:
    metadata = read_metadata(data, label)
    if metadata.get("format") == "compact" or metadata.get("compact_version"):
        raise ValueError(f"{label}: compact-layout delta; the Python subscriber reads the TRL layout only "
                         "(publish with format='trl', or pull with the deltasync CLI)")
    if metadata.get("sparse") != "True":
        raise ValueError(f"{label}: not a sparse delta")
    tensors = load_safetensors(data)
    changed = {}
    for key in tensors:
        if key.endswith(".indices"):
            name = key[: -len(".indices")]
            values = tensors.get(f"{name}.values")
            if values is None:
                raise ValueError(f"{label}: {key} has no matching {name}.values")
            indices = tensors[key]
            if indices.dim() != 1 or values.dim() != 1 or indices.numel() != values.numel():
                raise ValueError(f"{label}: tensor {name}: indices and values are not 1-D of the same length")
            changed[name] = (indices.to(torch.int64), values)
    for key in tensors:
        if key.endswith(".values") and key[: -len(".values")] not in changed:
            raise ValueError(f"{label}: {key} has no matching indices")

    def digests(field):
        if field not in metadata:
            return None
        return {n: parse_hex_digest(h, label) for n, h in json.loads(metadata[field]).items()}

    base_version = metadata.get("base_version")
    return ParsedDelta(int(metadata["model_version"]), None if base_version in (None, "") else int(base_version),
                       changed, digests("base_digests"), digests("result_digests"))


def parse_anchor_part(data: bytes, label: str) -> tuple[dict[str, torch.Tensor], dict[str, int] | None, int]:
    metadata = read_metadata(data, label)
    if metadata.get("sparse") != "False":
        raise ValueError(f"{label}: not an anchor")
    digests = None
    if "digests" in metadata:
        digests = {n: parse_hex_digest(h, label) for n, h in json.loads(metadata["digests"]).items()}
    return load_safetensors(data), digests, int(metadata["model_version"])
