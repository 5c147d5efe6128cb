"""Maps a whole delta (HF names, flat HF indices) to runtime positions with a fixed handful of
tensor operations, whatever the number of tensors, in O(1) per changed element.

The HF tensors are laid end to end in one address space, each starting at a multiple of a block
size B = 2^k chosen so that (almost) every run of the index map starts and ends on a block
boundary. A table with one entry per block then holds the offset that turns an HF address into
a global runtime address (runtime tensors laid end to end as well), or "not held on this rank".
Runs that do not line up with blocks (rare: odd shard sizes) are looked up by binary search.

The HF tensors are visited in the order of the runtime positions they land at, so the runtime
positions of a delta come out ascending (one check, no sort) and split per runtime tensor with
one binary search per tensor.
"""
from __future__ import annotations

import math

import torch

from .index_map import IndexMap

NOT_HELD = -(2**62)
UNALIGNED = NOT_HELD + 1
MAX_BLOCK_BITS = 12


def _trailing_zero_bits(values: torch.Tensor, cap: int) -> int:
    """Largest k <= cap such that every value is a multiple of 2^k."""
    lowest = values & -values  # lowest set bit of each (0 for 0, which any k divides)
    lowest = lowest[lowest > 0]
    return cap if lowest.numel() == 0 else min(cap, int(lowest.min()).bit_length() - 1)


class _Layer:
    """Block table for the i-th place an HF element lands (tied / replicated copies: i > 0)."""

    def __init__(self, nblocks: int, device):
        self.table = torch.full((nblocks,), NOT_HELD, dtype=torch.int64)
        self.device = device
        self.fallback: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # hf, length, rt (global)
        self.all_held = False

    def finish(self, unaligned: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        if unaligned:
            hf = torch.cat([u[0] for u in unaligned])
            order = torch.argsort(hf)
            self.fallback = (hf[order].to(self.device), torch.cat([u[1] for u in unaligned])[order].to(self.device),
                             torch.cat([u[2] for u in unaligned])[order].to(self.device))
        self.all_held = not bool((self.table <= UNALIGNED).any())
        self.table = self.table.to(self.device)


class DeltaMap:
    def __init__(self, imap: IndexMap, device=None):
        device = device if device is not None else (imap.params[0].device if imap.params else torch.device("cpu"))
        self.imap = imap
        sizes = [p.numel() for p in imap.params]
        self.param_base = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0)
        # HF tensors in the order of where they land, so positions come out ascending.
        def landing(name):
            t = imap.targets[name][0]
            return int(self.param_base[t.param_index]) + int(t.rt_start.min())
        self.order = sorted((n for n, ts in imap.targets.items() if ts), key=landing)
        self.rank = {n: i for i, n in enumerate(self.order)}
        starts = [t.hf_start for n in self.order for t in imap.targets[n]]
        lengths = [t.length for n in self.order for t in imap.targets[n]]
        both = torch.cat(starts + lengths) if starts else torch.zeros(0, dtype=torch.int64)
        self.block_bits = _trailing_zero_bits(both, MAX_BLOCK_BITS)
        block = 1 << self.block_bits
        self.hf_base: dict[str, int] = {}
        base = 0
        for n in self.order:
            self.hf_base[n] = base
            base += -(-math.prod(imap.hf_tensors[n][1]) // block) * block
        self.base_by_rank = torch.tensor([self.hf_base[n] for n in self.order], dtype=torch.int64)
        nblocks = base >> self.block_bits
        self.layers: list[_Layer] = []
        unaligned: list[list] = []
        for n in self.order:
            for depth, t in enumerate(imap.targets[n]):
                if depth == len(self.layers):
                    self.layers.append(_Layer(nblocks, device))
                    unaligned.append([])
                hf = t.hf_start + self.hf_base[n]
                rt = t.rt_start + int(self.param_base[t.param_index])
                aligned = ((hf | t.length) & (block - 1)) == 0
                if bool(aligned.any()):
                    a_hf, a_len, a_rt = hf[aligned], t.length[aligned], rt[aligned]
                    per_run = a_len >> self.block_bits
                    first_block = torch.repeat_interleave(a_hf >> self.block_bits, per_run)
                    within = torch.arange(int(per_run.sum())) - torch.repeat_interleave(per_run.cumsum(0) - per_run, per_run)
                    self.layers[depth].table[first_block + within] = torch.repeat_interleave(a_rt - a_hf, per_run)
                if not bool(aligned.all()):
                    u = ~aligned
                    u_hf, u_len, u_rt = hf[u], t.length[u], rt[u]
                    lo, hi = u_hf >> self.block_bits, (u_hf + u_len - 1) >> self.block_bits
                    for a, b in zip(lo.tolist(), hi.tolist()):
                        self.layers[depth].table[a:b + 1] = UNALIGNED
                    unaligned[depth].append((u_hf, u_len, u_rt))
        for layer, u in zip(self.layers, unaligned):
            layer.finish(u)
        self.param_base = self.param_base.to(device)
        self.base_by_rank = self.base_by_rank.to(device)

    def names_in_order(self, names) -> list[str]:
        """The delta's tensors that land on this rank, in landing order."""
        return sorted((n for n in names if n in self.rank), key=self.rank.__getitem__)

    def map(self, names: list[str], indices: torch.Tensor, counts: torch.Tensor):
        """indices: the HF flat indices of `names` (in names_in_order order) back to back, counts
        per name. Returns (rows: which of them are written -- None for all, in order --, local
        positions, count per runtime tensor), positions grouped by runtime tensor, ascending."""
        bases = self.base_by_rank[torch.tensor([self.rank[n] for n in names], dtype=torch.int64, device=indices.device)]
        address = indices + torch.repeat_interleave(bases, counts.to(indices.device))
        rows_parts, pos_parts = [], []
        for layer in self.layers:
            offset = layer.table[address >> self.block_bits]
            if layer.all_held:
                rows_parts.append(None)
                pos_parts.append(address + offset)
                continue
            held = offset > UNALIGNED
            rows = held.nonzero().reshape(-1)
            pos = address[rows] + offset[rows]
            if layer.fallback is not None:
                odd = (offset == UNALIGNED).nonzero().reshape(-1)
                if odd.numel():
                    f_hf, f_len, f_rt = layer.fallback
                    a = address[odd]
                    r = (torch.searchsorted(f_hf, a, right=True) - 1).clamp(min=0)
                    inside = (a >= f_hf[r]) & (a < f_hf[r] + f_len[r])
                    odd, a, r = odd[inside], a[inside], r[inside]
                    rows, pos = torch.cat([rows, odd]), torch.cat([pos, f_rt[r] + (a - f_hf[r])])
                    rows, perm = torch.sort(rows)
                    pos = pos[perm]
            rows_parts.append(rows)
            pos_parts.append(pos)
        if len(self.layers) == 1:
            rows, pos = rows_parts[0], pos_parts[0]
        else:
            n = address.numel()
            rows = torch.cat([torch.arange(n, device=address.device) if r is None else r for r in rows_parts])
            pos = torch.cat(pos_parts)
        if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
            pos, perm = torch.sort(pos)
            rows = perm if rows is None else rows[perm]
            if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
                raise ValueError("deltasync.vllm: a delta writes one runtime element twice")
        cuts = torch.searchsorted(pos, self.param_base)
        per_param = cuts.diff()
        local = pos - torch.repeat_interleave(self.param_base[:-1], per_param)
        return rows, local, per_param
