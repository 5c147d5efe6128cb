"""Delta and anchor files, through the C++ library (the native module's plain functions,
torch_ext/src/bindings/delta_files.cpp: delta_io.hpp,
delta_file.hpp, compact_codec.hpp, integrity.hpp). Layouts, metadata and digest keys are the
library's; this module only turns model descriptions and tensors into their arguments.

Delta layouts: "trl" (NAME.indices + NAME.values, the interoperable layout) and "compact"
(entropy-coded, values relative to the base bits: reading one needs the base weights in host
memory). Both carry the versions and base_digests / result_digests. Anchor parts hold the
tensors whole with model_version, anchor_part "k/n" and their checkpoint digests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from ._dtypes import ST_DTYPE
from ._library import native

# A model description: (name, torch dtype, shape) per tensor, in model order.
Meta = list[tuple[str, torch.dtype, tuple[int, ...]]]


def _model_args(meta: Meta):
    names = [n for n, _, _ in meta]
    dtypes = []
    for name, dtype, _ in meta:
        if dtype not in ST_DTYPE:
            raise ValueError(f"deltasync: tensor {name}: dtype {dtype} has no safetensors name")
        dtypes.append(ST_DTYPE[dtype])
    ranks = [len(shape) for _, _, shape in meta]
    dims = [int(d) for _, _, shape in meta for d in shape]
    return names, dtypes, ranks, dims


def _signed(d: int) -> int:
    """A 64-bit unsigned digest as the int64 the ops take."""
    d &= (1 << 64) - 1
    return d - (1 << 64) if d >= 1 << 63 else d


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def serialize_delta(format: str, meta: Meta, indices: torch.Tensor, values: torch.Tensor,
                    base_values: torch.Tensor | None, counts: list[int], version: int, base_version: int | None,
                    base_digests: list[int], result_digests: list[int]) -> bytes:
    """The encode's host-staged output (int64 indices, value bytes, base bytes -- needed by
    "compact" --, per-tensor counts) as delta bytes; digests are per tensor in model order."""
    out = native().delta_serialize(format, *_model_args(meta), indices, values.view(torch.uint8),
                                 None if base_values is None else base_values.view(torch.uint8),
                                 torch.tensor(counts, dtype=torch.int64), version, base_version,
                                 [_signed(d) for d in base_digests], [_signed(d) for d in result_digests])
    return out.numpy().tobytes()


def merge_deltas(meta: Meta, older: tuple, newer: tuple) -> tuple:
    """Two consecutive staged deltas, each (indices, values, base_values, counts) in the encode's
    host layout, as one from the older's base to the newer's result (C++ merge_deltas): union of
    positions, newest values, oldest base values. Returns the same tuple (counts as a list)."""
    args = []
    for indices, values, base_values, counts in (older, newer):
        args += [indices, values.view(torch.uint8), base_values.view(torch.uint8),
                 torch.tensor(counts, dtype=torch.int64)]
    indices, values, base_values, counts = native().delta_merge(*_model_args(meta), *args)
    return indices, values, base_values, counts.tolist()


def serialize_anchor_part(meta: Meta, tensors: list[torch.Tensor], version: int, part: int, parts: int,
                          digests: list[int]) -> bytes:
    out = native().anchor_serialize(*_model_args(meta), [t.contiguous() for t in tensors], version, part, parts,
                                  [_signed(d) for d in digests])
    return out.numpy().tobytes()


@dataclass
class ParsedDelta:
    version: int
    base_version: int | None
    format: str
    changed: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (int64 positions, values), model order
    base_digests: dict[str, int] | None
    result_digests: dict[str, int] | None
    # True for a compact delta read without the base: `changed` then holds unbased values, which
    # rebase_values() turns into the new bits given the base bits at the same positions.
    relative: bool = False


def parse_delta(data: bytes, label: str, meta: Meta, base: list[torch.Tensor] | None = None) -> ParsedDelta:
    """Reads a delta of either layout and resolves it against the model `meta` (names, dtypes,
    shapes checked in C++). `base` (the model's tensors on the CPU, in meta order) is needed
    for compact deltas to be decoded here; without it a compact delta comes back `relative`."""
    (fmt, relative, version, base_version, names, indices, values, counts, has_digests, digest_names, base_d,
     result_d) = native().delta_read(_bytes_tensor(data), label, *_model_args(meta), base)
    dtype_of = {n: d for n, d, _ in meta}
    counts = counts.tolist()
    index_parts = torch.split(indices, counts)
    widths = [torch.empty(0, dtype=dtype_of[n]).element_size() for n in names]
    value_parts = torch.split(values, [c * w for c, w in zip(counts, widths)])
    changed = {n: (i, v.view(dtype_of[n])) for n, i, v in zip(names, index_parts, value_parts)}
    mask = (1 << 64) - 1
    base_digests = {n: d & mask for n, d in zip(digest_names, base_d)} if has_digests else None
    result_digests = {n: d & mask for n, d in zip(digest_names, result_d)} if has_digests else None
    return ParsedDelta(version, None if base_version < 0 else base_version, fmt, changed, base_digests,
                       result_digests, relative)


def rebase_values(unbased: torch.Tensor, base_bits: torch.Tensor, counts: list[int], widths: list[int]) -> torch.Tensor:
    """Second phase of a relative compact read (C++ compact::rebase_values): the new bits (uint8,
    CPU) from the unbased values and the base bits gathered at the same positions; counts[t]
    elements of widths[t] bytes per tensor, back to back."""
    return native().compact_rebase(unbased.reshape(-1).view(torch.uint8).cpu().contiguous(),
                                 base_bits.reshape(-1).view(torch.uint8).cpu().contiguous(),
                                 torch.tensor(counts, dtype=torch.int64), widths)


def parse_anchor_part(data: bytes, label: str) -> tuple[dict[str, torch.Tensor], dict[str, int] | None, int]:
    """(tensors, checkpoint digests or None, model_version) of an anchor part."""
    version, has_digests, names, digests = native().anchor_read_digests(_bytes_tensor(data), label)
    mask = (1 << 64) - 1
    return load_safetensors(data), ({n: d & mask for n, d in zip(names, digests)} if has_digests else None), version
