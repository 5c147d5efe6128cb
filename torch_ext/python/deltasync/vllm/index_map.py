"""How a Hugging Face parameter's flat indices land in a vLLM worker's runtime parameters.

vLLM fuses q/k/v and gate/up projections, shards tensors for tensor parallelism (along the
output or the input dimension), pads vocabularies and ties embeddings; its loaders know all
that. We ask them once: every runtime parameter is filled with a sentinel (-1), then each HF
tensor is loaded through the model's own `load_weights` as a probe whose elements are digits of
their own flat index (small integers, exact in any float dtype, 1..B-1, so that 0 -- which
loaders use to fill padding -- is told apart). Reading back which runtime elements now hold
which digits, pass after pass, gives for each runtime element the HF index it came from.
The result is compressed into runs of positions contiguous on both sides, so a TP shard of a
row-sharded matrix is one run and a column-sharded one is one run per row -- never one entry
per element.

Applying a delta: for each changed HF index, a binary search over the runs of each target gives
the runtime position; the positions of all targets then go into one deltasync apply (one
scatter). O(changed · log runs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SENTINEL = -1.0

# Largest B such that the integers -1 .. B-1 are exact in the dtype.
_EXACT_INTEGERS = {
    torch.bfloat16: 257, torch.float16: 2049, torch.float32: 2**24 + 1,
    torch.float8_e4m3fn: 17, torch.float8_e5m2: 9,
}


def digit_base(dtypes) -> int:
    return min(_EXACT_INTEGERS.get(d, 0) for d in dtypes)


@dataclass
class TargetRuns:
    """Runs of one HF tensor inside one runtime parameter, sorted by hf_start (non-overlapping).

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


@dataclass
class IndexMap:
    """Everything one worker knows about where HF tensors live in its runtime parameters."""

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


def _runs(hf: torch.Tensor, rt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    order = torch.argsort(hf)
    hf, rt = hf[order], rt[order]
    if hf.numel() > 1 and bool((hf[1:] == hf[:-1]).any()):
        raise ValueError("an HF element lands twice in one runtime parameter")
    breaks = torch.ones(hf.numel(), dtype=torch.bool, device=hf.device)
    if hf.numel() > 1:
        breaks[1:] = (hf[1:] != hf[:-1] + 1) | (rt[1:] != rt[:-1] + 1)
    starts = breaks.nonzero().reshape(-1)
    ends = torch.cat([starts[1:], torch.tensor([hf.numel()], device=hf.device)])
    return hf[starts], ends - starts, rt[starts]


@torch.no_grad()
def learn_index_maps(model: torch.nn.Module, hf_tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                     load_weights=None) -> IndexMap:
    """Probes `model` through its own load_weights (or the given callable). Destroys the
    model's weights: load real ones afterwards (an anchor)."""
    load = load_weights or model.load_weights
    named = [(n, p) for n, p in model.named_parameters() if p.dtype.is_floating_point]
    names = [n for n, _ in named]
    params = [p.data for _, p in named]
    device = params[0].device
    base = digit_base({p.dtype for p in params} | {d for d, _ in hf_tensors.values()}) - 1  # digits 1..base
    if base < 2:
        raise ValueError("deltasync.vllm: parameter dtypes cannot hold probe digits")
    for p in params:
        p.fill_(SENTINEL)
    targets: dict[str, list[TargetRuns]] = {}
    for hf_name, (dtype, shape) in hf_tensors.items():
        numel = math.prod(shape)
        positions = torch.arange(numel, device=device, dtype=torch.int64)
        passes = max(1, math.ceil(math.log(max(numel, 2)) / math.log(base)))
        touched: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (param, runtime positions, hf index)
        scale = 1
        for j in range(passes):
            digit = (positions // scale) % base + 1
            load([(hf_name, digit.to(dtype).reshape(shape))])
            if j == 0:
                for k, p in enumerate(params):
                    flat = p.reshape(-1)
                    written = (flat != SENTINEL).nonzero().reshape(-1)
                    if written.numel():
                        touched.append((k, written, torch.zeros_like(written)))
            for t, (k, written, index) in enumerate(touched):
                flat = params[k].reshape(-1)
                values = flat.index_select(0, written).to(torch.float32)
                if j == 0:
                    # Elements a loader sets to a constant (padding rows filled with 0) are not copies.
                    copied = (values >= 1) & (values <= base)
                    written, values, index = written[copied], values[copied], index[copied]
                    touched[t] = (k, written, index)
                elif bool(((values < 1) | (values > base)).any()):
                    raise ValueError(f"deltasync.vllm: the loader of {hf_name} does not copy values (probe changed)")
                index += (values.to(torch.int64) - 1) * scale
            # Reset what the probe wrote (constant fills included) for the next pass / tensor.
            for k, _, _ in touched:
                params[k].fill_(SENTINEL)
            scale *= base
        runs = []
        for k, written, index in touched:
            if written.numel() == 0:
                continue
            if bool(((index < 0) | (index >= numel)).any()):
                raise ValueError(f"deltasync.vllm: probe of {hf_name} decoded to out-of-range indices")
            hf_start, length, rt_start = _runs(index, written)
            runs.append(TargetRuns.build(k, hf_start, length, rt_start))
        targets[hf_name] = runs
    return IndexMap(names, params, dict(hf_tensors), targets)


@dataclass
class _Layer:
    hf_start: torch.Tensor  # int64 [R], global HF positions, ascending, non-overlapping
    length: torch.Tensor
    rt_start: torch.Tensor  # int64 [R], global runtime positions


class GlobalMap:
    """All runs of all HF tensors in one table, so a whole delta maps with a handful of kernels
    whatever the number of tensors: HF positions are offset by a per-tensor base (tensors laid
    end to end), runtime positions by a per-parameter base. An HF tensor that lands in several
    runtime parameters contributes one run table per extra target ("layers")."""

    def __init__(self, imap: IndexMap, device):
        self.imap = imap
        self.hf_base: dict[str, int] = {}
        base = 0
        for name, (_, shape) in imap.hf_tensors.items():
            self.hf_base[name] = base
            base += math.prod(shape)
        param_numel = [p.numel() for p in imap.params]
        self.param_base = torch.tensor([0] + param_numel, dtype=torch.int64).cumsum(0)
        per_layer: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        for name, targets in imap.targets.items():
            for depth, t in enumerate(targets):
                if depth == len(per_layer):
                    per_layer.append([])
                per_layer[depth].append((t.hf_start + self.hf_base[name], t.length,
                                         t.rt_start + int(self.param_base[t.param_index])))
        self.layers = []
        for runs in per_layer:
            hf = torch.cat([r[0] for r in runs])
            order = torch.argsort(hf)
            self.layers.append(_Layer(hf[order].to(device), torch.cat([r[1] for r in runs])[order].to(device),
                                      torch.cat([r[2] for r in runs])[order].to(device)))
        self.param_base = self.param_base.to(device)

    def map(self, global_hf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(source row of each runtime write, global runtime position), all layers."""
        rows, positions = [], []
        for layer in self.layers:
            r = torch.searchsorted(layer.hf_start, global_hf, right=True) - 1
            rc = r.clamp(min=0)
            offset = global_hf - layer.hf_start[rc]
            held = (r >= 0) & (offset < layer.length[rc])
            rows.append(held.nonzero().reshape(-1))
            positions.append((layer.rt_start[rc] + offset)[held])
        if len(self.layers) == 1:
            return rows[0], positions[0]
        return torch.cat(rows), torch.cat(positions)

    def split(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global runtime positions -> (order that groups them by parameter, ascending; local
        positions in that order; count per parameter)."""
        order = None
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            positions, order = torch.sort(positions)
        param = torch.searchsorted(self.param_base, positions, right=True) - 1
        local = positions - self.param_base[param]
        counts = torch.bincount(param, minlength=len(self.imap.params))
        return order, local, counts
