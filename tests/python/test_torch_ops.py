"""torch.ops.deltasync against plain torch reference code, opcheck, and torch.compile.

Bits are compared through integer views, so -0.0 vs +0.0 and NaN payloads count."""
from __future__ import annotations

import pytest
import torch

import deltasync
from deltasync import ops

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(INT_VIEW[t.element_size()])


def random_tensor(shape, dtype, generator, device="cpu"):
    return (torch.randn(shape, generator=generator) * 0.05).to(dtype).to(device)


def perturb(t: torch.Tensor, fraction: float, generator) -> torch.Tensor:
    """A copy where about `fraction` of the elements moved by one ulp (bit pattern + 1)."""
    out = t.clone()
    flat = bits(out)
    mask = torch.rand(flat.shape, generator=generator) < fraction
    flat[mask.to(flat.device)] += 1
    return out


def reference_encode(current, shadow):
    """ne + nonzero + index_select per tensor: the eager torch equivalent of ops.encode."""
    indices, values, counts = [], [], []
    for cur, sh in zip(current, shadow):
        changed = torch.ne(bits(cur), bits(sh)).nonzero().reshape(-1)
        indices.append(changed)
        values.append(bits(cur).index_select(0, changed).view(torch.uint8))
        counts.append(changed.numel())
    return torch.cat(indices), torch.cat(values), torch.tensor(counts, dtype=torch.int64)


def model_like(dtype, generator, device="cpu"):
    shapes = [(64, 48), (48,), (0,), (3, 5, 7), (1000,)]
    return [random_tensor(s, dtype, generator, device) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_matches_eager_reference_and_updates_shadows(dtype):
    g = torch.Generator().manual_seed(1)
    shadow = model_like(dtype, g)
    current = [perturb(t, 0.05, g) for t in shadow]
    expected = reference_encode(current, shadow)
    indices, values, counts = ops.encode(current, shadow)
    assert indices.dtype == torch.int64 and values.dtype == torch.uint8 and counts.dtype == torch.int64
    assert torch.equal(indices, expected[0])
    assert torch.equal(values, expected[1])
    assert torch.equal(counts, expected[2])
    assert counts.sum() > 0
    for cur, sh in zip(current, shadow):
        assert torch.equal(bits(cur), bits(sh))


def test_encode_sees_signed_zero_and_nan_payloads():
    shadow = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.bfloat16)
    current = shadow.clone()
    current[0] = -0.0
    bits(current)[1] = bits(current)[1] ^ 1  # another NaN payload
    indices, values, counts = ops.encode([current], [shadow])
    assert indices.tolist() == [0, 1]
    assert torch.equal(values.view(torch.int16), bits(current)[:2])


def test_encode_with_base_returns_previous_bits():
    g = torch.Generator().manual_seed(2)
    shadow = model_like(torch.bfloat16, g)
    before = [t.clone() for t in shadow]
    current = [perturb(t, 0.1, g) for t in shadow]
    indices, values, base, counts = ops.encode_with_base(current, shadow)
    offset = 0
    for t, old in enumerate(before):
        n = int(counts[t])
        idx = indices[offset:offset + n]
        assert torch.equal(base.view(torch.int16)[offset:offset + n], bits(old).index_select(0, idx))
        offset += n


def test_encode_mixed_widths_and_second_encode_is_empty():
    g = torch.Generator().manual_seed(3)
    shadow = [random_tensor((300,), torch.float32, g), random_tensor((200,), torch.bfloat16, g),
              random_tensor((100,), torch.float8_e4m3fn, g)]
    current = [perturb(t, 0.2, g) for t in shadow]
    expected = reference_encode(current, shadow)
    got = ops.encode(current, shadow)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    again = ops.encode(current, shadow)
    assert again[0].numel() == 0 and again[1].numel() == 0 and again[2].tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_apply_matches_index_copy(dtype, index_dtype):
    g = torch.Generator().manual_seed(4)
    shadow = model_like(dtype, g)
    target = [t.clone() for t in shadow]
    current = [perturb(t, 0.05, g) for t in shadow]
    indices, values, counts = ops.encode(current, shadow)
    expected = [bits(t).clone() for t in target]
    offset, value_offset = 0, 0
    for t, exp in enumerate(expected):
        n, w = int(counts[t]), target[t].element_size()
        exp.index_copy_(0, indices[offset:offset + n], values[value_offset:value_offset + n * w].view(exp.dtype))
        offset, value_offset = offset + n, value_offset + n * w
    ops.apply(target, indices.to(index_dtype), values, counts)
    for got, exp, cur in zip(target, expected, current):
        assert torch.equal(bits(got), exp)
        assert torch.equal(bits(got), bits(cur))


def test_apply_accepts_values_in_the_tensor_dtype():
    target = torch.zeros(10, dtype=torch.bfloat16)
    ops.apply([target], torch.tensor([2, 9]), torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([2]))
    assert target[2] == 1.5 and target[9] == -2.0 and target.count_nonzero() == 2


@pytest.mark.parametrize(
    "indices, counts, message",
    [
        ([1, 50], [1, 1], "out of range"),
        ([1, 3, 2], [1, 2], "ascending"),
        ([1, 3, 3], [1, 2], "ascending"),
        ([1, -1], [1, 1], "range"),
    ],
)
def test_apply_rejects_bad_patches_and_writes_nothing(indices, counts, message):
    targets = [torch.zeros(20, dtype=torch.bfloat16), torch.zeros(30, dtype=torch.bfloat16)]
    values = torch.ones(len(indices), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message) as err:
        ops.apply(targets, torch.tensor(indices), values, torch.tensor(counts), names=["embed", "layers.0.w"])
    assert "layers.0.w" in str(err.value)
    assert all(t.count_nonzero() == 0 for t in targets)


def test_apply_rejects_inconsistent_sizes():
    target = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="indices"):
        ops.apply([target], torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.bfloat16), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="value bytes|too few"):
        ops.apply([target], torch.tensor([1, 2]), torch.ones(3, dtype=torch.bfloat16), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="one entry per target"):
        ops.apply([target], torch.tensor([1, 2]), torch.ones(2, dtype=torch.bfloat16), torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match="float64|8-byte"):
        ops.apply([target.double()], torch.tensor([1]), torch.ones(1, dtype=torch.float64), torch.tensor([1]))
    assert target.count_nonzero() == 0


def test_encode_rejects_mismatched_inputs():
    a = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="shadow has 9 elements"):
        ops.encode([a], [torch.zeros(9, dtype=torch.bfloat16)], names=["w"])
    with pytest.raises(RuntimeError, match="not contiguous"):
        ops.encode([torch.zeros(4, 4, dtype=torch.bfloat16).t()], [torch.zeros(16, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="empty tensor list"):
        ops.encode([], [])


# --- digest ---------------------------------------------------------------------------------

MASK = (1 << 64) - 1


def _mix64(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def reference_digest(t: torch.Tensor) -> int:
    """deltasync/digest_mix.hpp, written out in Python for small tensors."""
    w = t.element_size()
    unsigned = bits(t).tolist()
    seed = _mix64(((0 + 1) * 0x9E3779B97F4A7C15 & MASK) ^ (w * 0xD1B54A32D192ED03 & MASK))
    total = 0
    for i, b in enumerate(unsigned):
        b &= (1 << (8 * w)) - 1
        total = (total + _mix64(((i << 32) | b) ^ seed)) & MASK
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e5m2], ids=str)
def test_digest_matches_its_definition(dtype):
    g = torch.Generator().manual_seed(5)
    tensors = [random_tensor((37,), dtype, g), random_tensor((4, 9), dtype, g)]
    got = ops.digest(tensors)
    assert got.dtype == torch.int64 and got.shape == (2,)
    for value, t in zip(got.tolist(), tensors):
        assert value & MASK == reference_digest(t)


def test_digest_changes_with_any_element_and_follows_apply():
    g = torch.Generator().manual_seed(6)
    shadow = model_like(torch.bfloat16, g)
    target = [t.clone() for t in shadow]
    current = [perturb(t, 0.02, g) for t in shadow]
    before = ops.digest(target)
    indices, values, counts = ops.encode(current, shadow)
    ops.apply(target, indices, values, counts)
    after = ops.digest(target)
    assert torch.equal(after, ops.digest(current))
    changed = counts > 0
    assert torch.equal(after[changed] != before[changed], torch.ones(int(changed.sum()), dtype=torch.bool))


# --- opcheck and torch.compile ----------------------------------------------------------------

def test_opcheck_encode():
    g = torch.Generator().manual_seed(7)
    shadow = model_like(torch.bfloat16, g)
    current = [perturb(t, 0.1, g) for t in shadow]
    torch.library.opcheck(torch.ops.deltasync.encode.default, (current, [t.clone() for t in shadow]))
    torch.library.opcheck(torch.ops.deltasync.encode_with_base.default, (current, [t.clone() for t in shadow]))
    mixed_shadow = [shadow[0], shadow[1].float()]
    mixed_current = [current[0], perturb(shadow[1].float(), 0.1, g)]
    torch.library.opcheck(torch.ops.deltasync.encode.default, (mixed_current, [t.clone() for t in mixed_shadow]))


def test_opcheck_apply_and_digest():
    g = torch.Generator().manual_seed(8)
    shadow = model_like(torch.float16, g)
    current = [perturb(t, 0.1, g) for t in shadow]
    indices, values, counts = ops.encode(current, [t.clone() for t in shadow])
    torch.library.opcheck(torch.ops.deltasync.apply.default, ([t.clone() for t in shadow], indices, values, counts))
    torch.library.opcheck(torch.ops.deltasync.digest.default, (shadow,))


def test_ops_work_under_torch_compile():
    g = torch.Generator().manual_seed(9)
    shadow = model_like(torch.bfloat16, g)
    target = [t.clone() for t in shadow]
    current = [perturb(t, 0.05, g) for t in shadow]
    expected_changed = reference_encode(current, shadow)[0].numel()
    assert expected_changed > 0

    @torch.compile(fullgraph=True, backend="aot_eager")
    def sync(current, shadow, target):
        indices, values, counts = torch.ops.deltasync.encode(current, shadow)
        torch.ops.deltasync.apply(target, indices, values, counts)
        return indices.numel()

    changed = sync(current, shadow, target)
    assert changed == expected_changed
    for cur, sh, tg in zip(current, shadow, target):
        assert torch.equal(bits(cur), bits(sh))
        assert torch.equal(bits(cur), bits(tg))


# --- CUDA (skipped without a GPU and a CUDA build) ---------------------------------------------

requires_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and deltasync.has_cuda_ops()),
    reason="needs a CUDA device and a deltasync build with the CUDA backend",
)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_encode_and_apply_match_cpu(dtype):
    g = torch.Generator().manual_seed(10)
    shadow_cpu = model_like(dtype, g)
    current_cpu = [perturb(t, 0.05, g) for t in shadow_cpu]
    shadow = [t.cuda() for t in shadow_cpu]
    current = [t.cuda() for t in current_cpu]
    target = [t.clone() for t in shadow]
    base_cpu = [t.clone() for t in shadow_cpu]
    expected = ops.encode_with_base(current_cpu, shadow_cpu)
    got = ops.encode_with_base(current, shadow)
    for a, b in zip(got, expected):
        assert a.device.type == "cuda"
        assert torch.equal(a.cpu(), b)
    ops.apply(target, got[0], got[1], got[3])
    for tg, cur in zip(target, current):
        assert torch.equal(bits(tg), bits(cur))
    assert torch.equal(ops.digest(target), ops.digest(current_cpu))
    assert not torch.equal(ops.digest(base_cpu), ops.digest(current_cpu))


@requires_cuda
def test_cuda_apply_rejects_bad_patch_and_writes_nothing():
    targets = [torch.zeros(20, dtype=torch.bfloat16, device="cuda"), torch.zeros(30, dtype=torch.bfloat16, device="cuda")]
    with pytest.raises(RuntimeError, match="b.w"):
        ops.apply(targets, torch.tensor([1, 31], device="cuda"), torch.ones(2, dtype=torch.bfloat16, device="cuda"),
                  torch.tensor([1, 1]), names=["a.w", "b.w"])
    assert all(int(t.count_nonzero()) == 0 for t in targets)


@requires_cuda
def test_cuda_opcheck():
    g = torch.Generator().manual_seed(11)
    shadow = [t.cuda() for t in model_like(torch.bfloat16, g)]
    current = [perturb(t.cpu(), 0.1, g).cuda() for t in shadow]
    torch.library.opcheck(torch.ops.deltasync.encode.default, (current, [t.clone() for t in shadow]))
    indices, values, counts = ops.encode(current, [t.clone() for t in shadow])
    torch.library.opcheck(torch.ops.deltasync.apply.default, ([t.clone() for t in shadow], indices, values, counts))
