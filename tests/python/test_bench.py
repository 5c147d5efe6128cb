"""deltasync-bench smoke tests: the binary runs every CPU benchmark on a tiny problem, writes
well-formed CSV/JSON, checks its own results (it throws if an encode or apply computed the wrong
thing, which shows up here as a skipped row), and rejects bad command lines with one line.
No timing is asserted: these tests say the benchmark works, not how fast anything is."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bin_dir

REPO = Path(__file__).resolve().parents[2]
TINY = ["-a", "Elements=[2^12]", "-a", "ChangedShare=[0.01]", "-a", "Tensors=[1,model]", "--min-samples", "1",
        "--timeout", "0.01"]


@pytest.fixture(scope="module")
def bench():
    path = bin_dir() / "deltasync-bench"
    if not path.exists():
        pytest.fail(f"deltasync-bench not built: {path} is missing")
    return path


def run(bench, *args, check=True, tmp_path=None):
    env = {**os.environ, "TMPDIR": str(tmp_path)} if tmp_path else None
    proc = subprocess.run([str(bench), *args], capture_output=True, text=True, timeout=600, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"deltasync-bench {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def test_list_names_every_cpu_benchmark(bench):
    out = run(bench, "--list").stdout
    for name in ["encode", "apply", "digest", "serialize", "parse", "e2e", "e2e_full", "full_copy", "diff_scan",
                 "compact_encode", "compact_decode", "torch_encode", "torch_apply"]:
        assert f"  {name} [cpu]" in out, name


def test_all_cpu_benchmarks_run_and_verify_their_results(bench, tmp_path):
    json_path, csv_path = tmp_path / "r.json", tmp_path / "r.csv"
    proc = run(bench, "-d", "cpu", *TINY, "--json", str(json_path), "--csv", str(csv_path), tmp_path=tmp_path)
    report = json.loads(json_path.read_text())
    native = [r for r in report["results"] if not r["benchmark"].startswith("torch_")]
    assert native, "no native rows"
    failed = [(r["benchmark"], r["axes"], r["skipped"]) for r in native if r["skipped"]]
    assert not failed, failed
    for r in native:
        assert r["samples"] >= 1 and r["median_s"] > 0, r
        assert r["axes"]["Elements"] == "2^12"
    encode = [r for r in native if r["benchmark"] == "encode"]
    assert {r["axes"]["Tensors"] for r in encode} == {"1", "model"}
    # The inputs really change ~1% of the elements (the encode found what the inputs hold).
    for r in encode:
        changed = int(dict(kv.split("=") for kv in r["notes"].split())["changed"])
        assert 0 < changed < 4096 * 0.05, r["notes"]
    # Same-run peaks exist and utilization is computed against them.
    assert any(p["benchmark"] == "memcpy" for p in report["peaks"])
    assert all(r["peak_gb_per_s"] > 0 for r in encode)
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == len(report["peaks"]) + len(report["results"])
    assert "| benchmark | device |" in proc.stdout
    # Scratch files of the file benchmarks are cleaned up.
    assert not list(tmp_path.glob("deltasync-bench-*"))


def test_torch_rows_are_skipped_with_a_reason_without_torch_python(bench, tmp_path):
    json_path = tmp_path / "r.json"
    run(bench, "-b", "torch_encode", "-d", "cpu", *TINY, "--json", str(json_path), tmp_path=tmp_path)
    rows = json.loads(json_path.read_text())["results"]
    assert rows and all("torch-python" in r["skipped"] for r in rows)


def test_torch_rows_merge_when_torch_imports(bench, tmp_path):
    pytest.importorskip("torch")
    json_path = tmp_path / "r.json"
    run(bench, "-b", "torch_encode", "-b", "torch_apply", "-b", "encode", "-d", "cpu", *TINY, "--json", str(json_path),
        "--torch-python", sys.executable, "--torch-script", str(REPO / "benchmarks" / "torch_eager.py"), tmp_path=tmp_path)
    rows = json.loads(json_path.read_text())["results"]
    torch_rows = [r for r in rows if r["benchmark"].startswith("torch_")]
    assert len(torch_rows) == 4
    assert all(not r["skipped"] and r["median_s"] > 0 for r in torch_rows), torch_rows


def test_axis_ranges_expand(bench):
    out = run(bench, "--list", "-a", "Elements=[2^20:2^26:2]", "-a",
              "ChangedShare=[0.01:0.03:0.01]", "-a", "Dtype=[F8,BF16,F32]").stdout
    assert "Elements=[2^20,2^22,2^24,2^26]" in out
    assert "ChangedShare=[0.01,0.02,0.03]" in out
    assert "Dtype=[F8,BF16,F32]" in out
    out = run(bench, "--list", "-a", "Elements[pow2]=[20:22]").stdout
    assert "Elements=[2^20,2^21,2^22]" in out


@pytest.mark.parametrize("args, message", [
    (["-a", "Elements=[abc]"], "axis Elements"),
    (["-a", "Nope=[1]"], "unknown"),
    (["-a", "Dtype=[F64]"], "axis Dtype"),
    (["-a", "ChangedShare=[2]"], "within [0, 1]"),
    (["-b", "no_such_benchmark"], "unknown"),
    (["-d", "tpu"], "unknown device"),
    (["--min-samples"], "needs a value"),
])
def test_bad_command_lines_get_one_line(bench, args, message):
    proc = run(bench, *args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_an_explicit_device_that_cannot_run_is_an_error(bench):
    listing = run(bench, "--list").stdout
    if "devices: cpu cuda\n" in listing:
        pytest.skip("this machine has a usable CUDA device")
    proc = run(bench, "-d", "cuda", *TINY, check=False)
    assert proc.returncode == 2
    assert "device cuda:" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
