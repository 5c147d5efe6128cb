"""Records defined once: the C++ field tables (publisher_option_fields, version_stats_fields,
sync_report_fields in host/sync) are what the CLI's flags, the DeltaPublisher's keywords, the
Python dataclasses and the binding's dicts are made of, and the dtype table is the C++ one. Each
test lists the fields on every side and fails when one side has a field the others lack."""
from __future__ import annotations

import inspect
import re
from dataclasses import fields

import torch
from safetensors.torch import save_file

import deltasync
from deltasync import _dtypes, _files
from deltasync._library import native
from deltasync.publisher import PublishStats, publisher_defaults
from deltasync.subscriber import UpdateReport
from deltasync.trl import WeightSyncReport

OWN_CLI_FLAGS = {"--store", "--version", "--state", "--quiet"}
PYTHON_ONLY_KEYWORDS = {"model", "store", "low_memory", "log", "resume"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, generator=g).to(torch.bfloat16), "b": torch.randn(8, 4, generator=g)}


def test_publisher_options_are_the_cli_flags_and_python_keywords(run_cli, tmp_path):
    rows = native().publisher_option_fields()
    names = [name for name, _, _, _ in rows]
    assert "anchor_every" in names and "format" in names

    # Python: DeltaPublisher's keyword-only parameters, with the C++ defaults behind None.
    params = inspect.signature(deltasync.DeltaPublisher).parameters
    assert [p for p in params if p not in PYTHON_ONLY_KEYWORDS] == names
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names)
    assert publisher_defaults() == {name: default for name, _, default, _ in rows}

    # CLI: the publish command's usage lists exactly these flags besides its own.
    usage = next(line for line in run_cli("--help").stdout.splitlines() if line.strip().startswith("deltasync publish "))
    assert set(re.findall(r"--[a-z][a-z-]*", usage)) - OWN_CLI_FLAGS == {flag(n) for n in names}

    # ... and takes every one of them (each at its default value, so the publish must succeed).
    ckpt = tmp_path / "model.safetensors"
    save_file(model(), ckpt)
    args = []
    for name, _, default, _ in rows:
        if isinstance(default, bool):  # a switch: given when on
            args += [flag(name)] if default else []
        else:
            args += [flag(name), default]
    run_cli("publish", ckpt, "--store", f"file://{tmp_path / 'store'}", "--version", 1, "--quiet", *args)
    assert (tmp_path / "store" / "LATEST").read_text().splitlines()[0] == "1"


def test_unknown_publisher_keyword_is_a_type_error(tmp_path):
    try:
        deltasync.DeltaPublisher(model(), f"file://{tmp_path}", anchor_evry=3)
    except TypeError as e:
        assert "anchor_evry" in str(e)
    else:
        raise AssertionError("a misspelt keyword was accepted")


def test_stats_and_reports_are_the_cpp_records(tmp_path):
    stat_names = [row[0] for row in native().version_stats_fields()]
    report_names = [row[0] for row in native().update_report_fields()]
    assert [f.name for f in fields(PublishStats)] == stat_names + ["total_elements"]
    assert [f.name for f in fields(UpdateReport)] == report_names
    # The TRL report is the publisher's stats plus the trainer's and engine's own fields.
    assert [f.name for f in fields(WeightSyncReport)][:len(stat_names)] == stat_names

    # The dicts the binding hands over have exactly the table's keys.
    store = f"file://{tmp_path / 'store'}"
    weights = model()
    with deltasync.DeltaPublisher(weights, store) as pub:
        pub.publish(1)
    assert list(pub._native.history()[0]) == stat_names
    assert pub.stats[0].version == 1 and pub.stats[0].anchor and pub.stats[0].visible
    replica = {n: torch.zeros_like(t) for n, t in weights.items()}
    sub = deltasync.DeltaSubscriber(replica, store)
    assert sub.update() == 1
    report = sub.last_report
    assert isinstance(report, UpdateReport) and report.to_version == 1 and report.anchor == 1
    assert all(torch.equal(replica[n], weights[n]) for n in weights)


def test_one_dtype_table(tmp_path):
    rows = native().dtype_table()
    assert {name for name, _, _, _ in rows} >= {"BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "I32", "U8", "BOOL"}
    for name, width, weight, dtype in rows:
        assert torch.empty(0, dtype=dtype).element_size() == width, name
        assert _dtypes.ST_DTYPE[dtype] == name and _dtypes.TORCH_DTYPE[name] is dtype
        assert (dtype in _dtypes.WEIGHT_DTYPES) == weight
    assert _dtypes.WEIGHT_DTYPES == {torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2}
    assert _files.ST_DTYPE is _dtypes.ST_DTYPE  # the file helpers use the same table


def test_file_serializers_are_not_torch_ops():
    native()  # registers torch.ops.deltasync
    ops = torch.ops.deltasync
    for name in ("encode", "apply", "digest"):
        assert hasattr(ops, name)
    for name in ("delta_serialize", "delta_read", "delta_merge", "anchor_serialize", "anchor_read_digests", "compact_rebase"):
        assert hasattr(native(), name)
        assert not torch._C._dispatch_has_kernel(f"deltasync::{name}"), name
