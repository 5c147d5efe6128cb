"""Python entry points of torch.ops.deltasync, with the same semantics as the raw operators.

    indices, values, counts = deltasync.ops.encode(current, shadow)   # shadows updated in place
    deltasync.ops.apply(targets, indices, values, counts)             # targets updated in place

`values` are raw bytes (uint8): tensor t's new bits are the next counts[t] * element_size bytes.
values_as(values, dtype) reinterprets them for a single-dtype list.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import _fake  # noqa: F401  (registers the fake implementations; loads the library)

_ops = torch.ops.deltasync


def _non_empty(op: str, tensors) -> list:
    # The dispatcher picks CPU or CUDA from the tensors; an empty list has no device.
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"deltasync.{op}: empty tensor list")
    return tensors


def encode(current: Sequence[torch.Tensor], shadow: Sequence[torch.Tensor], names: Sequence[str] | None = None):
    """Bitwise diff of each current tensor against its shadow; brings the shadows up to date.

    Returns (indices int64, values uint8 bytes, counts int64) on the tensors' device."""
    return _ops.encode(_non_empty("encode", current), list(shadow), None if names is None else list(names))


def encode_with_base(current, shadow, names=None):
    """encode() plus the shadows' bits before the call (base_values, laid out like values)."""
    return _ops.encode_with_base(_non_empty("encode", current), list(shadow), None if names is None else list(names))


def apply(targets: Sequence[torch.Tensor], indices: torch.Tensor, values: torch.Tensor, counts: torch.Tensor,
          names: Sequence[str] | None = None) -> None:
    """Scatters the patches into the targets in place; on any invalid patch writes nothing."""
    _ops.apply(_non_empty("apply", targets), indices, values, counts, None if names is None else list(names))


def digest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Order-independent 64-bit digest per tensor (int64 tensor on the CPU)."""
    return _ops.digest(_non_empty("digest", tensors))


def digest_shift(indices: torch.Tensor, old_values: torch.Tensor, new_values: torch.Tensor, counts: torch.Tensor,
                 widths: Sequence[int]) -> torch.Tensor:
    """Per-tensor digest change (int64, mod 2^64) when the elements at `indices` go from
    old_values to new_values (encode's layout; CPU tensors). O(changed)."""
    return _ops.digest_shift(indices, old_values, new_values, counts, [int(w) for w in widths])


def values_as(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The raw value bytes of an encode seen as `dtype` elements (no copy)."""
    return values.view(dtype)


def digest_hex(value: int) -> str:
    """The 16-hex-digit form of a digest as stored in delta metadata."""
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"
