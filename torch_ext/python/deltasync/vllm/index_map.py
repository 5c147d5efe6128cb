"""How a Hugging Face parameter's flat indices land in a vLLM worker's runtime parameters.

vLLM fuses q/k/v and gate/up projections (and MoE experts into w13/w2), shards tensors for
tensor parallelism (along the output or the input dimension), pads vocabularies and ties
embeddings; its loaders know all that. We ask them once, without touching the live weights:

1. every floating runtime tensor (parameters and buffers) has its `.data` swapped for an
   integer *twin* of the same shape, on the host, filled with UNTOUCHED (-2);
2. every HF tensor is handed to the model's own `load_weights` as a probe holding, per element,
   its global position + 2 (tensors laid end to end with a gap of one between them, so no run
   crosses from one tensor into the next) -- exact in int32 (int64 past 2^31 elements). Probes
   are written into buffers reused once the loader has let go of them (fresh memory costs a page
   fault per 4 KiB, more than the writing). What a loader fills with 0 (vocabulary padding)
   reads back as 0;
3. one read of every twin, in C++ (deltasync's probe_runs), finds the runs where consecutive
   runtime elements hold consecutive probe values; each run is one (HF tensor, HF start, length,
   runtime start) entry. Stretches a loader fills with zeros -- vocabulary padding -- and what
   it never writes are no checkpoint element: deltas and anchors leave them as they are;
4. whatever happens, every `.data` is put back: the live weights are never written.

One load pass and one read pass: O(elements). The runs are few -- a row-sharded (or whole)
tensor is one run, a column-sharded one is one run per row.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .._library import native

UNTOUCHED = -2   # twin fill: no loader wrote here (below FIRST_PROBE, like a loader's zeros)
FIRST_PROBE = 2  # the smallest probe value


class LearnError(RuntimeError):
    """vLLM's loaders do not place the checkpoint's elements by plain copies."""


@dataclass
class TargetRuns:
    """Runs of one HF tensor inside one runtime tensor, sorted by hf_start (non-overlapping):
    HF elements [hf_start[r], +length[r]) sit at runtime positions [rt_start[r], +length[r]).
    Mapping deltas through them is the C++ mapped receiver's job (host/sync/mapped_receiver.hpp)."""

    param_index: int
    hf_start: torch.Tensor   # int64 [R]
    length: torch.Tensor     # int64 [R]
    rt_start: torch.Tensor   # int64 [R]

    @property
    def elements(self) -> int:
        return int(self.length.sum())


@dataclass
class IndexMap:
    """Everything one worker knows about where HF tensors live in its runtime tensors."""

    param_names: list[str]
    params: list[torch.Tensor]
    hf_tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    targets: dict[str, list[TargetRuns]]  # HF name -> where its elements go (may be empty: not on this rank)

    def runs(self) -> int:
        return sum(t.hf_start.numel() for ts in self.targets.values() for t in ts)

    def bytes(self) -> int:
        return self.runs() * 3 * 8

    def describe(self) -> str:
        mapped = sum(t.elements for ts in self.targets.values() for t in ts)
        return f"{len(self.targets)} HF tensors -> {len(self.params)} runtime params, {mapped} elements in {self.runs()} runs"


def floating_tensors(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """(full name, owning module, attribute, tensor) of every floating parameter and buffer, each
    storage once (tied weights are one parameter in vLLM)."""
    out, seen = [], set()
    for prefix, module in model.named_modules():
        for kind in (module._parameters, module._buffers):
            for attr, t in kind.items():
                if t is None or not t.dtype.is_floating_point or id(t) in seen:
                    continue
                seen.add(id(t))
                out.append((f"{prefix}.{attr}" if prefix else attr, module, attr, t))
    return out


@contextmanager
def data_swapped(tensors: list[torch.Tensor], replacements: list[torch.Tensor]):
    """Every tensor's `.data` is its replacement inside the block (requires_grad off: vLLM's
    parameters never need it, and an integer `.data` is refused on a tensor that requires grad);
    the originals are put back whatever happens, so the live weights are never written."""
    originals = [(t, t.data, t.requires_grad) for t in tensors]
    try:
        for (t, _, _), replacement in zip(originals, replacements):
            t.requires_grad_(False)
            t.data = replacement
        yield
    finally:
        for t, data, requires_grad in originals:
            t.data = data
            t.requires_grad_(requires_grad)


def _probe_bases(hf_tensors) -> tuple[dict[str, int], int]:
    bases, next_base = {}, FIRST_PROBE
    for name, (_, shape) in hf_tensors.items():
        bases[name] = next_base
        next_base += math.prod(shape) + 1
    return bases, next_base


def _probes(hf_tensors, bases, dtype):
    """(name, probe) per HF tensor, each probe a view of a pooled buffer: a buffer is written
    again only when nothing but the pool holds its storage any more (the loader copied the probe
    and let go of it, as vLLM's loaders do); a loader that keeps a probe keeps its buffer."""
    free_again = native().storage_use_count
    pool: list[torch.Tensor] = []
    for name, (_, shape) in hf_tensors.items():
        n = math.prod(shape)
        buffer = next((b for b in pool if b.numel() >= n and free_again(b) == 1), None)
        if buffer is None:
            buffer = torch.empty(n, dtype=dtype)
            pool.append(buffer)
        probe = torch.arange(bases[name], bases[name] + n, dtype=dtype, out=buffer[:n])
        yield name, probe.view(shape)
        del probe


@torch.no_grad()
def learn_index_maps(model: torch.nn.Module, hf_tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                     load_weights=None) -> IndexMap:
    """Learns the maps through `model.load_weights` (or the given callable) on twins of the
    runtime tensors; the live weights are not written, whatever happens."""
    load = load_weights or model.load_weights
    tensors = floating_tensors(model)
    bases, end = _probe_bases(hf_tensors)
    probe_dtype = torch.int32 if end < 2**31 else torch.int64
    twins = [torch.full(t.shape, UNTOUCHED, dtype=probe_dtype) for _, _, _, t in tensors]
    with data_swapped([t for _, _, _, t in tensors], twins):
        load(_probes(hf_tensors, bases, probe_dtype))
        loaded = []
        for (name, module, attr, t), twin in zip(tensors, twins):
            now = getattr(module, attr, None)
            if now is not t or t.data.data_ptr() != twin.data_ptr():
                raise LearnError(f"deltasync.vllm: vLLM's loader replaced runtime tensor {name} instead of "
                                 "copying into it; its weights cannot be updated in place")
            loaded.append(twin)
    return _decode(tensors, loaded, hf_tensors, bases)


def _decode(tensors, loaded, hf_tensors, bases) -> IndexMap:
    names = list(hf_tensors)
    base_table = torch.tensor([bases[n] for n in names], dtype=torch.int64)
    numels = torch.tensor([math.prod(hf_tensors[n][1]) for n in names], dtype=torch.int64)
    per_name: dict[str, list[TargetRuns]] = {n: [] for n in names}
    for k, ((rt_name, _, _, _), twin) in enumerate(zip(tensors, loaded)):
        flat = twin.reshape(-1)
        if flat.numel() == 0:
            continue
        starts, first, lengths = native().probe_runs(flat, FIRST_PROBE)
        if starts.numel() == 0:
            continue
        which = torch.searchsorted(base_table, first, right=True) - 1
        local = first - base_table[which]
        if bool((which < 0).any()) or bool((local + lengths > numels[which]).any()):
            raise LearnError(f"deltasync.vllm: runtime tensor {rt_name}: vLLM's loader computes values "
                             "(they decode to no checkpoint element); its weights cannot be updated in place")
        order = torch.argsort(which * (int(numels.max()) + 1) + local)
        which, local, lengths, starts = which[order], local[order], lengths[order], starts[order]
        groups = torch.unique_consecutive(which, return_counts=True)
        offset = 0
        for t_index, count in zip(groups[0].tolist(), groups[1].tolist()):
            hf_start, length, rt_start = (x[offset:offset + count] for x in (local, lengths, starts))
            offset += count
            if count > 1 and bool((hf_start[1:] < hf_start[:-1] + length[:-1]).any()):
                raise LearnError(f"deltasync.vllm: runtime tensor {rt_name} holds elements of {names[t_index]} "
                                 "twice; its weights cannot be updated in place")
            per_name[names[t_index]].append(TargetRuns(k, hf_start.clone(), length.clone(), rt_start.clone()))
    return IndexMap([n for n, _, _, _ in tensors], [t.data for _, _, _, t in tensors], dict(hf_tensors), per_name)
