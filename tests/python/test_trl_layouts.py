"""TRL's delta layouts both ways, against an independent writer and reader (trl_layouts.py):
files it writes apply bit-exact through `deltasync apply`; files `deltasync diff` and the Python
serialize path write decode with it to the new weights; bad files end with one line naming the
file and tensor, a non-zero exit and no output."""
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import trl_layouts as layouts

BRANCH_KEYS = {"format", "version", "sparse", "model_version", "num_changed_params", "total_changed_elements",
               "total_elements", "sparsity", "encoding"}


def make_models(seed=0):
    """A base and a next step: ~2% of elements changed by one ulp, one tensor unchanged, and
    changes in `wide` far enough apart that its gaps need uint32."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (300, 64), "layers.0.mlp.weight": (128, 64), "norm.weight": (64,),
              "frozen.weight": (32,), "wide.weight": (400, 500)}
    base = {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in shapes.items()}
    base["proj.f32"] = torch.randn(17, 3, generator=g)
    new = {}
    for name, t in base.items():
        b = layouts.bits(t).clone()
        if name == "wide.weight":
            mask = torch.zeros(b.shape, dtype=torch.bool)
            mask[[5, 70000, 70001, 199999]] = True  # gaps 5, 69994, 0, 129997
        elif name == "frozen.weight":
            mask = torch.zeros(b.shape, dtype=torch.bool)
        else:
            mask = torch.rand(b.shape, generator=g) < 0.02
        b[mask] ^= 1
        new[name] = b.view(t.dtype).reshape(t.shape)
    return base, new


@pytest.fixture
def models(tmp_path):
    base, new = make_models()
    save_file(base, tmp_path / "base.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    return tmp_path / "base.safetensors", tmp_path / "new.safetensors", base, new


def load(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_bit_identical(got: dict, want: dict):
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(layouts.bits(got[name]), layouts.bits(want[name])), name


@pytest.mark.parametrize("layout", ["blog", "raw", "gap_delta"])
def test_independent_writers_file_applies_bit_exact(run_cli, models, tmp_path, layout):
    base_path, _, base, new = models
    delta = tmp_path / "delta.safetensors"
    if layout == "blog":
        layouts.write_blog_delta(delta, base, new, model_version=7)
    else:
        layouts.write_branch_delta(delta, base, new, model_version=7, encoding=layout)
    if layout == "gap_delta":
        with safe_open(str(delta), framework="pt") as f:
            assert f.get_tensor("wide.weight.idx").dtype == torch.uint32  # the per-tensor fallback is exercised
            assert f.get_tensor("embed.weight.idx").dtype == torch.uint16
            assert f.get_tensor("frozen.weight.idx").numel() == 0
    out = tmp_path / "out.safetensors"
    run_cli("apply", base_path, delta, "-o", out)
    assert_bit_identical(load(out), new)


@pytest.mark.parametrize("fmt,encoding", [("trl", None), ("trl-idx-raw", "raw"), ("trl-idx", "gap_delta")])
def test_ours_read_back_with_the_independent_reader(run_cli, models, tmp_path, fmt, encoding):
    base_path, new_path, base, new = models
    delta = tmp_path / "delta.safetensors"
    run_cli("diff", base_path, new_path, "-o", delta, "--format", fmt, "--model-version", "8", "--base-version", "7")
    md, changes = layouts.read_delta(delta)
    assert_bit_identical(layouts.apply_delta(base, changes), new)
    out = tmp_path / "out.safetensors"  # and through deltasync apply, which checks the digests ours carry
    run_cli("apply", base_path, delta, "-o", out)
    assert_bit_identical(load(out), new)
    assert md["sparse"] == "True" and md["model_version"] == "8"
    if encoding is None:
        assert md["format"] == "trl"
        return
    assert BRANCH_KEYS <= set(md)
    assert md["format"] == "sparse_weight_patch" and md["version"] == "1" and md["encoding"] == encoding
    total_changed = sum(int((layouts.bits(base[n]) != layouts.bits(new[n])).sum()) for n in base)
    total = sum(t.numel() for t in base.values())
    # TRL's PatchMetadata parses these as int / float.
    changed_tensors = [n for n in base if not torch.equal(layouts.bits(base[n]), layouts.bits(new[n]))]
    assert "frozen.weight" not in changed_tensors and len(changed_tensors) >= 3
    assert int(md["num_changed_params"]) == len(changes) == len(changed_tensors)  # no pair for unchanged tensors
    assert int(md["total_changed_elements"]) == total_changed and int(md["total_elements"]) == total
    assert float(md["sparsity"]) == pytest.approx(1 - total_changed / total)
    if encoding == "gap_delta":
        with safe_open(str(delta), framework="pt") as f:
            assert f.get_tensor("wide.weight.idx").dtype == torch.uint32
            assert f.get_tensor("embed.weight.idx").dtype == torch.uint16


def test_python_serialize_path_writes_the_branch_layout(models, tmp_path):
    from deltasync import _files

    _, _, base, new = models
    names = list(base)
    meta = [(n, base[n].dtype, tuple(base[n].shape)) for n in names]
    positions = [layouts.changed_positions(base[n], new[n]) for n in names]
    indices = torch.from_numpy(np.concatenate(positions))
    values = torch.cat([new[n].flatten()[torch.from_numpy(p)].contiguous().view(torch.uint8)
                        for n, p in zip(names, positions)])
    counts = [p.size for p in positions]
    for fmt, encoding in (("trl-idx", "gap_delta"), ("trl-idx-raw", "raw")):
        data = _files.serialize_delta(fmt, meta, indices, values, None, counts, 3, 2, [0] * len(names),
                                      [0] * len(names))
        path = tmp_path / f"{fmt}.safetensors"
        path.write_bytes(data)
        md, changes = layouts.read_delta(path)
        assert md["encoding"] == encoding
        assert_bit_identical(layouts.apply_delta(base, changes), new)
        parsed = _files.parse_delta(data, "delta", meta)
        assert parsed.format == fmt and parsed.version == 3 and parsed.base_version == 2


def craft(path, tensors: dict, encoding="gap_delta", **extra):
    md = {"format": "sparse_weight_patch", "version": "1", "sparse": "True", "model_version": "2",
          "encoding": encoding, **extra}
    save_file(tensors, str(path), metadata=md)


BF16_2 = torch.zeros(2, dtype=torch.bfloat16)


@pytest.mark.parametrize("tensors,encoding,extra,reason", [
    # uint16 gaps whose positions run past the tensor's end (64 elements): 60, then 60 + 10 + 1
    ({"norm.weight.idx": torch.tensor([60, 10], dtype=torch.uint16), "norm.weight.val": BF16_2}, "gap_delta", {},
     "tensor norm.weight: position 71 (entry 1) is outside its 64 elements"),
    ({"norm.weight.idx": torch.tensor([9, 4], dtype=torch.int32), "norm.weight.val": BF16_2}, "raw", {},
     "tensor norm.weight: positions are not strictly ascending at entry 1 (4 after 9)"),
    ({"norm.weight.idx": torch.tensor([1, 2], dtype=torch.int32), "norm.weight.val": BF16_2}, "gap_delta", {},
     "tensor norm.weight.idx has dtype I32; encoding gap_delta stores U16 or U32 gaps"),
    ({"norm.weight.idx": torch.tensor([1.0, 2.0]), "norm.weight.val": BF16_2}, "raw", {},
     "tensor norm.weight.idx has dtype F32; encoding raw stores I32 (or I64) positions"),
    ({"norm.weight.idx": torch.tensor([1, 2], dtype=torch.uint16), "norm.weight.val": torch.zeros(2)}, "gap_delta",
     {}, "tensor norm.weight has dtype F32 in delta but BF16 in base"),
    ({"norm.weight.idx": torch.tensor([1, 2], dtype=torch.uint8), "norm.weight.val": BF16_2}, "nvcomp_cascaded", {},
     "metadata encoding \"nvcomp_cascaded\" (nvCOMP's GPU bitstream) is not supported"),
    ({"norm.weight.idx": torch.tensor([1, 2], dtype=torch.uint16), "norm.weight.val": BF16_2}, "gap_delta",
     {"num_changed_params": "4"}, "metadata num_changed_params is 4 but the file holds 1 changed tensors"),
])
def test_bad_branch_files_fail_with_one_line(run_cli, models, tmp_path, tensors, encoding, extra, reason):
    base_path, _, _, _ = models
    delta = tmp_path / "bad.safetensors"
    craft(delta, tensors, encoding, **extra)
    out = tmp_path / "out.safetensors"
    proc = run_cli("apply", base_path, delta, "-o", out, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(delta) in lines[0] and reason in lines[0], lines[0]
    assert not out.exists()
