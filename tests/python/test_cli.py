"""The deltasync CLI on real safetensors checkpoints written by the safetensors library:
diff/apply reproduce NEW byte for byte for every weight dtype and both delta layouts, deltas
read back with safe_open hold exactly the changed elements, and every bad input ends with one
line on stderr naming the file, a non-zero exit and no output file."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.element_size()]).flatten()


def make_model(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (257, 64), "layers.0.attn.qkv.weight": (96, 64), "layers.0.norm.weight": (64,),
              "lm_head.bias": (3,), "empty": (0, 5)}
    return {name: (torch.randn(shape, generator=g) * 0.05).to(dtype) for name, shape in shapes.items()}


def step(model, share, seed=1):
    """A copy where about `share` of each tensor's elements got a new bit pattern."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.items():
        b = bits(t).clone()
        mask = torch.rand(b.shape, generator=g) < share
        b[mask] ^= 1  # flip the lowest bit: one ulp, as most real changes are
        out[name] = b.view(t.dtype).reshape(t.shape)
    return out


@pytest.fixture
def checkpoints(tmp_path):
    def write(dtype, share=0.02):
        base = make_model(dtype)
        new = step(base, share)
        save_file(base, tmp_path / "base.safetensors", metadata={"note": "base"})
        save_file(new, tmp_path / "new.safetensors", metadata={"note": "base"})
        return tmp_path / "base.safetensors", tmp_path / "new.safetensors", base, new

    return write


@pytest.mark.parametrize("fmt", ["trl", "compact"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_diff_apply_reproduces_new_byte_for_byte(run_cli, checkpoints, tmp_path, dtype_name, fmt):
    base_path, new_path, _, _ = checkpoints(DTYPES[dtype_name])
    delta, out = tmp_path / "delta.safetensors", tmp_path / "out.safetensors"
    run_cli("diff", base_path, new_path, "-o", delta, "--format", fmt, "--model-version", 7)
    run_cli("apply", base_path, delta, "-o", out)
    assert out.read_bytes() == new_path.read_bytes()
    assert not list(tmp_path.glob("*.tmp.*")), "temporary files left behind"


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_trl_delta_holds_exactly_the_changed_elements(run_cli, checkpoints, tmp_path, dtype_name):
    base_path, new_path, base, new = checkpoints(DTYPES[dtype_name], share=0.05)
    delta = tmp_path / "delta.safetensors"
    run_cli("diff", base_path, new_path, "-o", delta, "--format", "trl", "--model-version", 3, "--base-version", 2)
    with safe_open(delta, "pt") as f:
        md = f.metadata()
        keys = set(f.keys())
        assert md["sparse"] == "True" and md["model_version"] == "3" and md["base_version"] == "2"
        changed = json.loads(md["changed_params"])
        total_changed = 0
        for name in base:
            want = (bits(base[name]) != bits(new[name])).nonzero().flatten()
            if want.numel() == 0:
                assert name not in changed and f"{name}.indices" not in keys
                continue
            assert name in changed
            idx = f.get_tensor(f"{name}.indices")
            vals = f.get_tensor(f"{name}.values")
            assert idx.dtype == torch.int32 and vals.dtype == DTYPES[dtype_name]
            assert torch.equal(idx.long(), want)
            assert torch.equal(bits(vals), bits(new[name])[want])
            total_changed += want.numel()
        assert int(md["total_changed_elements"]) == total_changed
        assert int(md["total_elements"]) == sum(t.numel() for t in base.values())
        assert set(json.loads(md["base_digests"])) == set(changed)


def test_identical_checkpoints_give_an_empty_delta(run_cli, checkpoints, tmp_path):
    base_path, _, _, _ = checkpoints(torch.bfloat16)
    delta, out = tmp_path / "delta.safetensors", tmp_path / "out.safetensors"
    run_cli("diff", base_path, base_path, "-o", delta)
    info = run_cli("inspect", delta).stdout
    assert "kind: delta" in info and "changed elements: 0 of" in info
    run_cli("apply", base_path, delta, "-o", out)
    assert out.read_bytes() == base_path.read_bytes()


def test_inspect_reports_kind_version_and_counts(run_cli, checkpoints, tmp_path):
    base_path, new_path, base, new = checkpoints(torch.bfloat16)
    delta = tmp_path / "delta.safetensors"
    run_cli("diff", base_path, new_path, "-o", delta, "--model-version", 12)
    text = run_cli("inspect", delta).stdout
    changed = sum(int((bits(base[n]) != bits(new[n])).sum()) for n in base)
    assert "kind: delta" in text and "version: 12" in text
    assert f"changed elements: {changed} of {sum(t.numel() for t in base.values())}" in text
    assert "kind: checkpoint" in run_cli("inspect", base_path).stdout


def test_a_chain_of_deltas_applies_in_order(run_cli, tmp_path):
    versions = [make_model(torch.bfloat16)]
    for k in range(1, 4):
        versions.append(step(versions[-1], 0.01, seed=k))
    for k, model in enumerate(versions):
        save_file(model, tmp_path / f"v{k}.safetensors", metadata={"model_version": str(k)})
    current = tmp_path / "v0.safetensors"
    for k in range(1, 4):
        run_cli("diff", tmp_path / f"v{k-1}.safetensors", tmp_path / f"v{k}.safetensors", "-o", tmp_path / f"d{k}.safetensors")
        out = tmp_path / f"r{k}.safetensors"
        run_cli("apply", current, tmp_path / f"d{k}.safetensors", "-o", out)
        with safe_open(out, "pt") as f:
            assert f.metadata()["model_version"] == str(k)
            for name, t in versions[k].items():
                assert torch.equal(bits(f.get_tensor(name)), bits(t)), name
        current = out
    # Skipping a version is refused: d3 expects version 2, r1 is version 1.
    bad = run_cli("apply", tmp_path / "r1.safetensors", tmp_path / "d3.safetensors", "-o", tmp_path / "x.safetensors",
                  check=False)
    assert bad.returncode != 0
    assert "expects base version 2, found version 1" in bad.stderr
    assert not (tmp_path / "x.safetensors").exists()


def expect_failure(run_cli, tmp_path, *args, names, reason):
    out = tmp_path / "out.safetensors"
    proc = run_cli(*args, "-o", out, check=False)
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(names) in lines[0] and reason in lines[0], lines[0]
    assert not out.exists()
    assert not list(tmp_path.glob("*.tmp.*"))


def test_missing_and_corrupt_inputs_are_refused(run_cli, checkpoints, tmp_path):
    base_path, new_path, _, _ = checkpoints(torch.bfloat16)
    missing = tmp_path / "nope.safetensors"
    expect_failure(run_cli, tmp_path, "diff", base_path, missing, names=missing, reason="")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(new_path.read_bytes()[:-10])
    expect_failure(run_cli, tmp_path, "diff", base_path, corrupt, names=corrupt, reason="")
    expect_failure(run_cli, tmp_path, "apply", base_path, corrupt, names=corrupt, reason="")


def test_delta_for_another_base_is_refused(run_cli, checkpoints, tmp_path):
    base_path, new_path, base, _ = checkpoints(torch.bfloat16)
    delta = tmp_path / "delta.safetensors"
    run_cli("diff", base_path, new_path, "-o", delta)
    # Another model: one tensor missing, one of another shape, one of another dtype.
    other = dict(base)
    del other["embed.weight"]
    save_file(other, tmp_path / "missing.safetensors")
    expect_failure(run_cli, tmp_path, "apply", tmp_path / "missing.safetensors", delta, names=delta,
                   reason="embed.weight")
    reshaped = dict(base)
    reshaped["layers.0.attn.qkv.weight"] = base["layers.0.attn.qkv.weight"].reshape(64, 96)
    save_file(reshaped, tmp_path / "reshaped.safetensors")
    expect_failure(run_cli, tmp_path, "apply", tmp_path / "reshaped.safetensors", delta, names=delta,
                   reason="layers.0.attn.qkv.weight")
    retyped = dict(base)
    retyped["layers.0.norm.weight"] = base["layers.0.norm.weight"].float()
    save_file(retyped, tmp_path / "retyped.safetensors")
    expect_failure(run_cli, tmp_path, "apply", tmp_path / "retyped.safetensors", delta, names=delta,
                   reason="layers.0.norm.weight")
    # Same names, shapes and dtypes but other bits: the base digests catch it.
    drifted = step(base, 0.01, seed=99)
    save_file(drifted, tmp_path / "drifted.safetensors")
    expect_failure(run_cli, tmp_path, "apply", tmp_path / "drifted.safetensors", delta, names=delta,
                   reason="expects base version")


def test_out_of_range_and_unsorted_indices_are_refused(run_cli, checkpoints, tmp_path):
    base_path, _, base, _ = checkpoints(torch.bfloat16)
    n = base["layers.0.norm.weight"].numel()
    vals = torch.ones(2, dtype=torch.bfloat16)
    for indices, reason in [([1, n], f"index {n} out of range"), ([5, 3], "not strictly ascending")]:
        delta = tmp_path / "hand.safetensors"
        save_file({"layers.0.norm.weight.indices": torch.tensor(indices, dtype=torch.int32),
                   "layers.0.norm.weight.values": vals},
                  delta, metadata={"sparse": "True", "model_version": "1", "sparsity": "0.9",
                                   "changed_params": json.dumps(["layers.0.norm.weight"])})
        expect_failure(run_cli, tmp_path, "apply", base_path, delta, names="layers.0.norm.weight", reason=reason)


def test_numbers_with_a_sign_or_a_space_are_refused(run_cli, checkpoints, tmp_path):
    """Every number the CLI reads (flags, checkpoint and delta metadata, the environment) goes
    through the one strict parser: std::stoull took " 7" and "+7" as 7 and "-1" as 2^64-1."""
    base_path, new_path, base, _ = checkpoints(torch.bfloat16)
    for flag in ["-1", "+7", " 7", "7x", "18446744073709551616"]:
        expect_failure(run_cli, tmp_path, "diff", base_path, new_path, "--model-version", flag,
                       names="option --model-version", reason=f"'{flag}': ")
    store = f"file://{tmp_path / 'store'}"
    for flag in ["-1", "+3"]:
        proc = run_cli("publish", new_path, "--store", store, "--version", flag, "--quiet", check=False)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [f"deltasync publish: option --version '{flag}': not a decimal integer"], proc.stderr
    for share in ["inf", "-0.5", " 0.5"]:
        proc = run_cli("publish", new_path, "--store", store, "--version", "1", "--anchor-share", share, "--quiet", check=False)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [f"deltasync publish: option --anchor-share '{share}': not a decimal number"], proc.stderr
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.json"))

    # A checkpoint's recorded version and a delta's model_version: refused naming the file.
    signed = tmp_path / "signed.safetensors"
    save_file(base, signed, metadata={"model_version": "+7"})
    expect_failure(run_cli, tmp_path, "diff", signed, new_path, names=signed,
                   reason="metadata model_version '+7': not a decimal integer")
    delta = tmp_path / "d.safetensors"
    run_cli("diff", base_path, new_path, "-o", delta, "--format", "trl")
    with safe_open(delta, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = dict(f.metadata())
    for version in [" 7", "+7"]:
        hand = tmp_path / "hand.safetensors"
        save_file(tensors, hand, metadata=dict(metadata, model_version=version))
        expect_failure(run_cli, tmp_path, "apply", base_path, hand, names=hand,
                       reason=f"metadata model_version '{version}': not a decimal integer")

    # The publisher's state folder: the shadow's recorded version and counters.
    state = tmp_path / "state"
    run_cli("publish", base_path, "--store", store, "--version", "1", "--state", state, "--quiet")
    shadow = state / "shadow.safetensors"
    with safe_open(shadow, "pt") as f:
        shadow_tensors = {k: f.get_tensor(k) for k in f.keys()}
        shadow_metadata = dict(f.metadata())
    for key, value, what in [("delta_bytes_since_anchor", "+5", "state metadata delta_bytes_since_anchor"),
                             ("model_version", " 1", "metadata model_version")]:
        save_file(shadow_tensors, shadow, metadata=dict(shadow_metadata, **{key: value}))
        proc = run_cli("publish", new_path, "--store", store, "--version", "2", "--state", state, "--quiet", check=False)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [f"deltasync publish: {shadow}: {what} '{value}': not a decimal integer"], proc.stderr

    # The worker pool's size from the environment.
    proc = run_cli("diff", base_path, new_path, "-o", tmp_path / "t.safetensors", env={"DELTASYNC_THREADS": "+2"}, check=False)
    assert proc.returncode != 0 and "DELTASYNC_THREADS '+2': not a decimal integer" in proc.stderr, proc.stderr


def test_backend_flags(run_cli, checkpoints, tmp_path):
    base_path, new_path, _, _ = checkpoints(torch.float32)
    delta = tmp_path / "d.safetensors"
    out = run_cli("diff", base_path, new_path, "-o", delta, "--cpu").stdout
    assert "cpu backend" in out
    if not torch.cuda.is_available():
        proc = run_cli("diff", base_path, new_path, "-o", tmp_path / "g.safetensors", "--gpu", check=False)
        assert proc.returncode != 0 and "--gpu" in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU backend against the CPU one)")
@pytest.mark.parametrize("fmt", ["compact", "trl"])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32", "float8_e4m3fn"])
def test_gpu_diff_writes_the_cpu_bytes_and_applies_alike(run_cli, checkpoints, tmp_path, fmt, dtype_name):
    """--gpu encodes (and for compact, codes) on the device: the file must be the CPU backend's,
    byte for byte, and applying it on either backend must give the same checkpoint."""
    base_path, new_path, _, _ = checkpoints(getattr(torch, dtype_name))
    deltas = {}
    for backend in ("--cpu", "--gpu"):
        deltas[backend] = tmp_path / f"d{backend}.safetensors"
        out = run_cli("diff", base_path, new_path, "-o", deltas[backend], "--format", fmt, backend).stdout
        assert {"--cpu": "cpu backend", "--gpu": "cuda backend"}[backend] in out
    assert deltas["--cpu"].read_bytes() == deltas["--gpu"].read_bytes()
    outs = {}
    for backend in ("--cpu", "--gpu"):
        outs[backend] = tmp_path / f"o{backend}.safetensors"
        run_cli("apply", base_path, deltas["--gpu"], "-o", outs[backend], backend)
    assert outs["--cpu"].read_bytes() == outs["--gpu"].read_bytes() == new_path.read_bytes()


@pytest.mark.parametrize("fmt", ["compact", "trl"])
def test_demo_keeps_the_receiver_bit_identical(run_cli, tmp_path, fmt):
    out = run_cli("demo", "--steps", 4, "--vocab", 512, "--hidden", 64, "--intermediate", 160, "--layers", 1,
                  "--lr", "3e-6", "--format", fmt, "--dir", tmp_path, "--keep").stdout
    step_lines = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(step_lines) == 4 and all(line.endswith("bit-identical") for line in step_lines), out
    files = sorted(tmp_path.glob("delta-*.safetensors"))
    assert len(files) == 4
    with safe_open(files[-1], "pt") as f:
        assert f.metadata()["format"] == fmt and f.metadata()["base_version"] == "3"
