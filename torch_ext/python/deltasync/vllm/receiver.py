"""The vLLM side of a subscriber: the index map learned through vLLM's own loaders
(index_map.py) handed to the C++ mapped receiver (host/sync/mapped_receiver.hpp), which fetches,
verifies, maps and applies every delta in O(changed) -- including the digest checks, done per
rank over the elements it owns and summed across the tensor-parallel group -- and writes every
anchor through the same map, agreed by every rank before any rank writes.

Ownership: a replicated element (a norm, a KV head shared by several ranks) is held by several
ranks but must enter the digest sum once; each rank owns what it holds minus what lower ranks
hold (interval arithmetic over the runs, exchanged once at set-up)."""
from __future__ import annotations

import torch

from .._library import native
from .._dtypes import ST_DTYPE
from .index_map import IndexMap

MASK = (1 << 64) - 1


def merged(ranges) -> list[tuple[int, int]]:
    """(start, length) ranges, sorted and merged where they overlap or touch."""
    out: list[list[int]] = []
    for s, n in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s + n)
        else:
            out.append([s, s + n])
    return [(s, e - s) for s, e in out]


def held_ranges(imap: IndexMap) -> dict[str, list[tuple[int, int]]]:
    """HF name -> sorted, merged (start, length) ranges of the elements held on this rank."""
    return {name: merged((int(s), int(n)) for t in targets for s, n in zip(t.hf_start.tolist(), t.length.tolist()))
            for name, targets in imap.targets.items()}


def _subtract(ranges: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """ranges minus taken (both sorted, disjoint (start, length) lists)."""
    out, j = [], 0
    for s, n in ranges:
        a, b = s, s + n
        while j < len(taken) and taken[j][0] + taken[j][1] <= a:
            j += 1
        k = j
        while a < b:
            if k < len(taken) and taken[k][0] < b:
                ts, te = taken[k][0], taken[k][0] + taken[k][1]
                if ts > a:
                    out.append((a, ts - a))
                a = max(a, te)
                k += 1
            else:
                out.append((a, b - a))
                break
    return out


def owned_ranges(held: dict[str, list[tuple[int, int]]], rank: int, all_held: list[dict] | None) -> dict:
    """This rank's elements for digests: what it holds minus what any lower rank holds."""
    if not all_held:
        return held
    owned = {}
    for name, ranges in held.items():
        taken = merged(r for lower in all_held[:rank] for r in lower.get(name, []))
        owned[name] = _subtract(ranges, taken)
    return owned


def digest_combiner(group):
    """Sums per-tensor digest partials (mod 2^64) over a torch.distributed process group (a
    gloo group: the partials are a few hundred integers on the CPU); None on one rank."""
    if group is None:
        return None

    def combine(partials: list[int]) -> list[int]:
        t = torch.tensor([p - (1 << 64) if p >= 1 << 63 else p for p in partials], dtype=torch.int64)
        group.allreduce([t]).wait()  # int64 sums wrap mod 2^64, which is what the digest needs
        return [x & MASK for x in t.tolist()]

    return combine


def exchange_held(held: dict, group) -> list[dict] | None:
    """Every rank's held ranges (rank order), over the group; None on one rank."""
    if group is None:
        return None
    import pickle

    mine = torch.frombuffer(bytearray(pickle.dumps(held)), dtype=torch.uint8)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
    group.allgather([sizes], [size]).wait()
    longest = int(max(int(s) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(group.size())]
    group.allgather([gathered], [padded]).wait()
    return [pickle.loads(g[:int(s)].numpy().tobytes()) for g, s in zip(gathered, sizes)]


def mapped_subscriber(store: str, imap: IndexMap, group=None, rank: int = 0, log=None):
    """The C++ subscriber over a worker's runtime parameters, verified across `group`."""
    names = list(imap.hf_tensors)
    index = {n: i for i, n in enumerate(names)}
    hf = [(n, ST_DTYPE[dtype], [int(d) for d in shape]) for n, (dtype, shape) in imap.hf_tensors.items()]
    runs = [(index[n], t.param_index, t.hf_start.cpu(), t.length.cpu(), t.rt_start.cpu())
            for n, targets in imap.targets.items() for t in targets]
    held = held_ranges(imap)
    all_held = exchange_held(held, group)
    owned = owned_ranges(held, rank, all_held)
    owned_list = [(index[n], torch.tensor([s for s, _ in r], dtype=torch.int64), torch.tensor([k for _, k in r], dtype=torch.int64))
                  for n, r in owned.items() if r]
    # Tensors no rank holds (vLLM's loader skips a tied lm_head): verified against the store's
    # promises only, see MappedModel::unserved.
    unserved = [index[n] for n in names if not any(h.get(n) for h in (all_held or [held]))]
    return native().MappedSubscriber(store, hf, imap.param_names, imap.params, runs, owned_list, unserved,
                                     digest_combiner(group), log)
