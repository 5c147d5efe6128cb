"""deltasync.delta_merge (the publisher's catch-up merge of two staged deltas, over the C++
merge_deltas): the merged delta, and the op's refusal of staged arrays that disagree."""
from __future__ import annotations

import pytest
import torch

from deltasync._files import _model_args, merge_deltas
from deltasync._library import native

META = [("a", torch.bfloat16, (10,)), ("b", torch.float32, (2, 2))]


def staged(indices_per_tensor, values_per_tensor, bases_per_tensor):
    """A staged delta (indices, values, base_values, counts) from per-tensor lists."""
    indices = torch.tensor([i for idx in indices_per_tensor for i in idx], dtype=torch.int64)
    counts = [len(idx) for idx in indices_per_tensor]

    def raw(per_tensor):
        parts = [torch.tensor(v, dtype=dtype).view(torch.uint8) for v, (_, dtype, _) in zip(per_tensor, META)]
        return torch.cat(parts)

    return indices, raw(values_per_tensor), raw(bases_per_tensor), counts


def test_merge_takes_the_union_with_newest_values_and_oldest_base_values():
    # older: base B -> A, newer: A -> C
    older = staged([[1, 5], []], [[1.5, 2.5], []], [[1.0, 2.0], []])
    newer = staged([[5, 7], [0, 3]], [[3.5, 4.5], [7.0, 8.0]], [[2.5, 4.0], [6.0, 7.5]])
    indices, values, base_values, counts = merge_deltas(META, older, newer)
    assert counts == [3, 2]
    assert indices.tolist() == [1, 5, 7, 0, 3]
    expected_values = staged([[1, 5, 7], [0, 3]], [[1.5, 3.5, 4.5], [7.0, 8.0]], [[1.0, 2.0, 4.0], [6.0, 7.5]])
    assert torch.equal(values, expected_values[1])
    assert torch.equal(base_values, expected_values[2])  # 5: the older's base (2.0), not the newer's (2.5)


def test_merging_empty_deltas_is_empty():
    empty = staged([[], []], [[], []], [[], []])
    indices, values, base_values, counts = merge_deltas(META, empty, empty)
    assert counts == [0, 0] and indices.numel() == 0 and values.numel() == 0 and base_values.numel() == 0


def raw_merge(older, newer):
    args = []
    for indices, values, base_values, counts in (older, newer):
        args += [indices, values, base_values, torch.tensor(counts, dtype=torch.int64)]
    return native().delta_merge(*_model_args(META), *args)


def test_merge_refuses_counts_beyond_the_tensor_naming_the_argument():
    ok = staged([[1], []], [[1.5], []], [[1.0], []])
    with pytest.raises(RuntimeError, match=r"delta_merge: tensor b: newer_counts entry 5 outside 0\.\.4"):
        raw_merge(ok, (torch.zeros(5, dtype=torch.int64), torch.zeros(20, dtype=torch.uint8),
                       torch.zeros(20, dtype=torch.uint8), [0, 5]))


def test_merge_refuses_counts_whose_sizes_wrap_around():
    # 2^62 changes in each of four 1-element tensors: the offsets sum to 2^64, i.e. 0, which an
    # unchecked op would take for an empty delta and then read 2^62 indices from nothing.
    meta = [(f"t{k}", torch.bfloat16, (1,)) for k in range(4)]
    huge = torch.tensor([1 << 62] * 4, dtype=torch.int64)
    empty_i, empty_b = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.uint8)
    zero = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="delta_merge: tensor t0: older_counts entry"):
        native().delta_merge(*_model_args(meta), empty_i, empty_b, empty_b, huge, empty_i, empty_b, empty_b, zero)
    # The same counts are possible for tensors of 2^62 elements: refused against the arrays.
    huge_meta = [(f"t{k}", torch.bfloat16, (1 << 62,)) for k in range(4)]
    with pytest.raises(RuntimeError, match="delta_merge: older_indices/older_values sizes disagree with older_counts"):
        native().delta_merge(*_model_args(huge_meta), empty_i, empty_b, empty_b, huge, empty_i, empty_b, empty_b, zero)


def test_merge_refuses_sizes_that_disagree_with_the_counts():
    ok = staged([[1], []], [[1.5], []], [[1.0], []])
    short_values = (ok[0], ok[1][:1], ok[2], ok[3])
    with pytest.raises(RuntimeError, match="delta_merge: older_indices/older_values sizes disagree with older_counts"):
        raw_merge(short_values, ok)
    no_base = (ok[0], ok[1], torch.zeros(0, dtype=torch.uint8), ok[3])
    with pytest.raises(RuntimeError, match="older delta lacks base values"):
        raw_merge(no_base, ok)
