"""How a Hugging Face parameter's flat indices land in a vLLM worker's runtime parameters.

vLLM fuses q/k/v and gate/up projections (and MoE experts into w13/w2), shards tensors for
tensor parallelism (along the output or the input dimension), pads vocabularies and ties
embeddings; its loaders know all that. We ask them once, without touching the live weights:

1. every floating runtime tensor (parameters and buffers) has its `.data` swapped for an
   integer *twin* of the same shape, on the host, filled with UNTOUCHED (-2);
2. every HF tensor is handed to the model's own `load_weights` as a probe holding, per element,
   its global position + 2 (tensors laid end to end with a gap of one between them, so no run
   crosses from one tensor into the next) -- exact in int32 (int64 past 2^31 elements). What a
   loader fills with 0 (vocabulary padding) reads back as 0;
3. one read of every twin finds the runs where consecutive runtime elements hold consecutive
   probe values; each run is one (HF tensor, HF start, length, runtime start) entry, and each
   stretch of loader-written zeros is kept too (an anchor load writes them, as a fresh load does);
4. whatever happens, every `.data` is put back: the live weights are never written.

One load pass and one read pass: O(elements). The runs are few -- a row-sharded (or whole)
tensor is one run, a column-sharded one is one run per row -- and a run table whose runs are
evenly spaced on both sides is also kept as two strides (plain arithmetic to map).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CHUNK = 1 << 20  # twin elements read per step when finding runs (keeps temporaries in cache)
UNTOUCHED = -2   # twin fill: no loader wrote here (steps to 0 or to a probe value >= 2 are never 0 or +1)


class LearnError(RuntimeError):
    """vLLM's loaders do not place the checkpoint's elements by plain copies."""


@dataclass
class TargetRuns:
    """Runs of one HF tensor inside one runtime tensor, sorted by hf_start (non-overlapping).

    Runs that are evenly spaced on both sides with one length -- a column-sharded matrix: one
    run per row -- are also kept as (hf_stride, rt_stride), which turns a lookup into plain
    arithmetic."""

    param_index: int
    hf_start: torch.Tensor   # int64 [R]
    length: torch.Tensor     # int64 [R]
    rt_start: torch.Tensor   # int64 [R]
    hf_stride: int | None = None
    rt_stride: int | None = None

    @staticmethod
    def build(param_index: int, hf_start: torch.Tensor, length: torch.Tensor, rt_start: torch.Tensor) -> "TargetRuns":
        runs = TargetRuns(param_index, hf_start, length, rt_start)
        if hf_start.numel() > 1 and bool((length == length[0]).all()):
            hf_steps, rt_steps = hf_start.diff(), rt_start.diff()
            if bool((hf_steps == hf_steps[0]).all()) and bool((rt_steps == rt_steps[0]).all()) \
                    and int(hf_steps[0]) >= int(length[0]):
                runs.hf_stride, runs.rt_stride = int(hf_steps[0]), int(rt_steps[0])
        return runs

    @property
    def elements(self) -> int:
        return int(self.length.sum())

    def lookup(self, hf_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask of the indices this target holds, their runtime positions)."""
        if self.hf_start.numel() == 1 or self.hf_stride is not None:
            first, length = int(self.hf_start[0]), int(self.length[0])
            rel = hf_indices - first
            if self.hf_stride is None:
                held = (rel >= 0) & (rel < length)
                return held, rel[held] + int(self.rt_start[0])
            run, offset = torch.div(rel, self.hf_stride, rounding_mode="floor"), rel.remainder(self.hf_stride)
            held = (rel >= 0) & (run < self.hf_start.numel()) & (offset < length)
            return held, int(self.rt_start[0]) + run[held] * self.rt_stride + offset[held]
        r = torch.searchsorted(self.hf_start, hf_indices, right=True) - 1
        rc = r.clamp(min=0)
        held = (r >= 0) & (hf_indices < self.hf_start[rc] + self.length[rc])
        positions = self.rt_start[rc] + (hf_indices - self.hf_start[rc])
        return held, positions[held]

    def copy_into(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """target (runtime, flat view) <- the elements of source (the HF tensor) it holds."""
        flat_t, flat_s = target.reshape(-1), source.reshape(-1)
        if self.hf_stride is not None:
            rows, length = self.hf_start.numel(), int(self.length[0])
            dst = flat_t.as_strided((rows, length), (self.rt_stride, 1), int(self.rt_start[0]))
            src = flat_s.as_strided((rows, length), (self.hf_stride, 1), int(self.hf_start[0]))
            dst.copy_(src)
            return
        for h, n, r in zip(self.hf_start.tolist(), self.length.tolist(), self.rt_start.tolist()):
            flat_t[r:r + n].copy_(flat_s[h:h + n])


@dataclass
class IndexMap:
    """Everything one worker knows about where HF tensors live in its runtime tensors."""

    param_names: list[str]
    params: list[torch.Tensor]
    hf_tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    targets: dict[str, list[TargetRuns]]  # HF name -> where its elements go (may be empty: not on this rank)
    zero_fills: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # runtime tensor -> (starts, lengths) loaders zero

    def write_zero_fills(self) -> None:
        for k, (starts, lengths) in (self.zero_fills or {}).items():
            flat = self.params[k].reshape(-1)
            for s, n in zip(starts.tolist(), lengths.tolist()):
                flat[s:s + n].zero_()

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


def _probe_bases(hf_tensors) -> tuple[dict[str, int], int]:
    bases, next_base = {}, 2
    for name, (_, shape) in hf_tensors.items():
        bases[name] = next_base
        next_base += math.prod(shape) + 1
    return bases, next_base


def _segments(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) of the maximal segments of `flat` whose steps are +1 or 0 (a run of probe
    values, or a stretch of zeros or of UNTOUCHED). One read of `flat`, in cache-sized chunks."""
    n = flat.numel()
    cuts = [torch.zeros(1, dtype=torch.int64)]
    if n > 1:
        step = torch.empty(min(CHUNK, n - 1), dtype=flat.dtype)
        not_one = torch.empty(step.numel(), dtype=torch.bool)
        not_zero = torch.empty(step.numel(), dtype=torch.bool)
        for s in range(1, n, CHUNK):
            e = min(s + CHUNK, n)
            k = e - s
            d = torch.sub(flat[s:e], flat[s - 1:e - 1], out=step[:k])
            torch.ne(d, 1, out=not_one[:k])
            torch.ne(d, 0, out=not_zero[:k])
            not_one[:k].logical_and_(not_zero[:k])
            cuts.append(not_one[:k].nonzero().reshape(-1) + s)
    starts = torch.cat(cuts)
    ends = torch.cat([starts[1:], torch.tensor([n], dtype=torch.int64)])
    return starts, ends


@torch.no_grad()
def learn_index_maps(model: torch.nn.Module, hf_tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                     load_weights=None) -> IndexMap:
    """Learns the maps through `model.load_weights` (or the given callable) on twins of the
    runtime tensors; the live weights are not written, whatever happens."""
    load = load_weights or model.load_weights
    tensors = floating_tensors(model)
    bases, end = _probe_bases(hf_tensors)
    probe_dtype = torch.int32 if end < 2**31 else torch.int64
    # An integer .data is refused on a tensor that requires grad; vLLM's never need it.
    originals = [(t, t.data, t.requires_grad) for _, _, _, t in tensors]
    twins = [torch.full(t.shape, UNTOUCHED, dtype=probe_dtype) for _, _, _, t in tensors]
    try:
        for (t, _, _), twin in zip(originals, twins):
            t.requires_grad_(False)
            t.data = twin

        def probes():
            for name, (_, shape) in hf_tensors.items():
                base = bases[name]
                yield name, torch.arange(base, base + math.prod(shape), dtype=probe_dtype).reshape(shape)

        load(probes())
        loaded = []
        for (name, module, attr, t), twin in zip(tensors, twins):
            now = getattr(module, attr, None)
            if now is not t or t.data.data_ptr() != twin.data_ptr():
                raise LearnError(f"deltasync.vllm: vLLM's loader replaced runtime tensor {name} instead of "
                                 "copying into it; its weights cannot be updated in place")
            loaded.append(twin)
    finally:
        for t, data, requires_grad in originals:
            t.data = data
            t.requires_grad_(requires_grad)
    return _decode(tensors, loaded, hf_tensors, bases)


def _decode(tensors, loaded, hf_tensors, bases) -> IndexMap:
    names = list(hf_tensors)
    base_table = torch.tensor([bases[n] for n in names], dtype=torch.int64)
    numels = torch.tensor([math.prod(hf_tensors[n][1]) for n in names], dtype=torch.int64)
    per_name: dict[str, list[TargetRuns]] = {n: [] for n in names}
    zero_fills: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for k, ((rt_name, _, _, _), twin) in enumerate(zip(tensors, loaded)):
        flat = twin.reshape(-1)
        if flat.numel() == 0:
            continue
        starts, ends = _segments(flat)
        first = flat.index_select(0, starts).to(torch.int64)
        last = flat.index_select(0, ends - 1).to(torch.int64)
        lengths = ends - starts
        zeros = first == 0
        if bool(zeros.any()):
            zero_fills[k] = (starts[zeros], lengths[zeros])
        mapped = first >= 2
        starts, lengths, first, last = starts[mapped], lengths[mapped], first[mapped], last[mapped]
        if starts.numel() == 0:
            continue
        if bool((last != first + lengths - 1).any()):
            raise LearnError(f"deltasync.vllm: runtime tensor {rt_name}: vLLM's loader writes one checkpoint element "
                             "to several places or computes values; its weights cannot be updated in place")
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
            per_name[names[t_index]].append(TargetRuns.build(k, hf_start.clone(), length.clone(), rt_start.clone()))
    return IndexMap([n for n, _, _, _ in tensors], [t.data for _, _, _, t in tensors], dict(hf_tensors), per_name,
                    zero_fills)
