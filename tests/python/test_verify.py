"""`deltasync verify`: recomputes a checkpoint's digests and compares them with its metadata.

The expected digests come from an independent numpy transcription of the definition in
host/include/deltasync/digest_mix.hpp, so these tests also pin the C++ digest to its spec.
"""
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x):
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def digest(array):
    """sum-mix64-v1 of a numpy array's raw bits (tensors below 2^32 elements)."""
    width = array.dtype.itemsize
    bits = array.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width]).astype(np.uint64)
    with np.errstate(over="ignore"):
        seed = mix64(np.array([0x9E3779B97F4A7C15 ^ ((width * 0xD1B54A32D192ED03) & 0xFFFFFFFFFFFFFFFF)], dtype=np.uint64))[0]
        positions = np.arange(bits.size, dtype=np.uint64)
        terms = mix64(((positions << np.uint64(32)) | bits) ^ seed)
        return int(terms.sum(dtype=np.uint64))


def hexd(value):
    return f"{value:016x}"


@pytest.fixture
def tensors():
    rng = np.random.default_rng(1)
    return {
        "embed": rng.integers(0, 1 << 16, size=(300, 64), dtype=np.uint16).view(np.float16),
        "norm": np.ones(64, dtype=np.float32),
        "q": rng.integers(0, 256, size=1000, dtype=np.uint8),
    }


def write(path, tensors, digests=None, extra=None):
    metadata = dict(extra or {})
    if digests is not None:
        metadata["digest_algorithm"] = "sum-mix64-v1"
        metadata["digests"] = json.dumps(digests)
    save_file(tensors, str(path), metadata=metadata)


# "auto" picks the GPU where one is present, so on a GPU machine both digest backends are checked
# against the numpy reference.
BACKENDS = [["--cpu"], []]


@pytest.mark.parametrize("backend", BACKENDS, ids=["cpu", "auto"])
def test_matching_digests_verify(tmp_path, tensors, run_cli, backend):
    path = tmp_path / "anchor.safetensors"
    write(path, tensors, {name: hexd(digest(t)) for name, t in tensors.items()})
    proc = run_cli("verify", path, *backend)
    assert proc.stdout.strip() == "OK: 3 tensors, 20264 elements verified"


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_every_cpu_code_path_matches_the_reference(tmp_path, tensors, run_cli, isa):
    # The CPU digest loop is compiled per instruction set and picked at run time;
    # DELTASYNC_DIGEST_ISA caps the choice so each path is checked here (a path the CPU lacks
    # falls back to the next one down).
    path = tmp_path / "anchor.safetensors"
    rng = np.random.default_rng(2)
    odd = {"odd": rng.integers(0, 1 << 16, size=2_500_003, dtype=np.uint16)}  # several 2^20 chunks, ragged tail
    everything = dict(tensors, **odd)
    write(path, everything, {name: hexd(digest(t)) for name, t in everything.items()})
    proc = run_cli("verify", path, "--cpu", env={"DELTASYNC_DIGEST_ISA": isa})
    assert proc.stdout.startswith("OK: 4 tensors")


@pytest.mark.parametrize("backend", BACKENDS, ids=["cpu", "auto"])
def test_a_flipped_sign_of_zero_is_caught(tmp_path, tensors, run_cli, backend):
    digests = {name: hexd(digest(t)) for name, t in tensors.items()}
    corrupt = dict(tensors)
    norm = tensors["norm"].copy()
    norm[5] = -0.0 if norm[5] == 0 else -norm[5]
    corrupt["norm"] = norm
    path = tmp_path / "anchor.safetensors"
    write(path, corrupt, digests)
    proc = run_cli("verify", path, *backend, check=False)
    assert proc.returncode == 1
    assert proc.stdout == ""
    line = proc.stderr.strip()
    assert "\n" not in line
    assert f"tensor norm digest mismatch: recorded {digests['norm']}, computed {hexd(digest(norm))}" in line


def test_digests_must_cover_exactly_the_files_tensors(tmp_path, tensors, run_cli):
    digests = {name: hexd(digest(t)) for name, t in tensors.items()}
    missing = dict(digests)
    del missing["q"]
    path = tmp_path / "a.safetensors"
    write(path, tensors, missing)
    proc = run_cli("verify", path, "--cpu", check=False)
    assert proc.returncode == 1 and "tensor q has no recorded digest" in proc.stderr

    extra = dict(digests, ghost="0123456789abcdef")
    write(path, tensors, extra)
    proc = run_cli("verify", path, "--cpu", check=False)
    assert proc.returncode == 1 and "digests name tensor ghost, which the file does not hold" in proc.stderr


def test_without_digests_prints_them_and_says_so(tmp_path, tensors, run_cli):
    path = tmp_path / "plain.safetensors"
    write(path, tensors)
    proc = run_cli("verify", path, "--cpu")
    printed = dict(line.split(" ") for line in proc.stdout.strip().splitlines())
    assert printed == {name: hexd(digest(t)) for name, t in tensors.items()}
    assert "records no digests; nothing to compare" in proc.stderr
    strict = run_cli("verify", path, "--cpu", "--require", check=False)
    assert strict.returncode == 1


def test_malformed_digest_metadata_is_an_error(tmp_path, tensors, run_cli):
    path = tmp_path / "bad.safetensors"
    digests = {name: hexd(digest(t)) for name, t in tensors.items()}
    digests["embed"] = digests["embed"].upper()
    write(path, tensors, digests)
    proc = run_cli("verify", path, "--cpu", check=False)
    assert proc.returncode == 1 and "not 16 lowercase hex digits" in proc.stderr and "embed" in proc.stderr


def test_a_delta_is_not_a_checkpoint(tmp_path, tensors, run_cli):
    path = tmp_path / "delta.safetensors"
    write(path, tensors, extra={"base_digests": "{}", "result_digests": "{}", "digest_algorithm": "sum-mix64-v1"})
    proc = run_cli("verify", path, "--cpu", check=False)
    assert proc.returncode == 1 and "is a delta" in proc.stderr
