"""Receivers stream anchors part by part. `deltasync pull` into OUT and a DeltaSubscriber into
host tensors: the peak memory each adds over a model many times larger than a part stays within
two parts (a memory bound is behaviour, not timing), the result is bit-exact, and a corrupt or
missing part in the middle of the anchor leaves an existing OUT / the subscriber's weights
exactly as they were (every byte, no temporary left)."""
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from pull_memory import peak_rss, write_model  # noqa: E402

from safetensors import safe_open  # noqa: E402

MODEL = 256 * 10**6   # 32 parts of 8 MB: the model is 32x a part
PART = 8 * 10**6
TENSOR = 4 * 10**6


@pytest.fixture(scope="module")
def published(tmp_path_factory, deltasync_bin):
    tmp = tmp_path_factory.mktemp("pull_memory")
    model = tmp / "model.safetensors"
    write_model(str(model), MODEL, TENSOR)
    store = tmp / "store"
    exe = str(deltasync_bin / "deltasync")
    rc, _, err = peak_rss([exe, "publish", model, "--store", store, "--version", 1, "--anchor-part-bytes", PART,
                           "--state", tmp / "state", "--quiet"])
    assert rc == 0, err
    return exe, model, store


def tensors(path):
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    out = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for name in st.keys():
                out[name] = st.get_tensor(name).view(torch.int16)
    return out


def snapshot(path):
    """Every file under path (or path itself) -> SHA-256 of its bytes."""
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "**"), recursive=True))
    return {f: hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files if os.path.isfile(f)}


@pytest.mark.parametrize("out_name", ["replica", "replica.safetensors"])
def test_pull_peak_memory_is_bounded_by_parts_not_the_model(published, tmp_path, out_name):
    exe, model, store = published
    _, idle, _ = peak_rss([exe, "pull"])  # a usage error: the binary's own footprint
    out = tmp_path / out_name
    rc, peak, err = peak_rss([exe, "pull", "--store", store, "-o", out, "--max-shard-bytes", 50 * 10**6, "--quiet"])
    assert rc == 0, err
    extra = peak - idle
    assert extra <= 2 * PART, f"pull peaked {extra / 1e6:.1f} MB above idle: more than 2 parts of {PART / 1e6:.0f} MB"
    if out_name == "replica":
        assert len(glob.glob(str(out / "*.safetensors"))) == 6  # 256 MB in shards of at most 50 MB
    want, got = tensors(str(model)), tensors(str(out))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    # Verifiable on its own: recorded version and digests.
    check = peak_rss([exe, "verify", out])
    assert check[0] == 0, check[2]


def broken_store(store, tmp_path, how):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    parts = sorted(glob.glob(str(copy / "anchors" / "*" / "part-*.safetensors")))
    middle = parts[len(parts) // 2]
    if how == "corrupt":
        with open(middle, "r+b") as f:
            f.seek(os.path.getsize(middle) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
    else:
        os.remove(middle)
    return copy, os.path.basename(middle)


@pytest.mark.parametrize("how", ["corrupt", "missing"])
@pytest.mark.parametrize("out_kind", ["folder", "file"])
def test_bad_part_mid_anchor_leaves_the_old_checkpoint_every_byte(published, tmp_path, how, out_kind):
    exe, model, store = published
    bad, part = broken_store(store, tmp_path, how)
    # An existing OUT at no recorded version: the catch-up is the anchor, streamed over it.
    parent = tmp_path / "out"
    parent.mkdir()
    if out_kind == "folder":
        out = parent / "ckpt"
        out.mkdir()
        shutil.copy(model, out / "model.safetensors")
        (out / "config.json").write_text("{}")
    else:
        out = parent / "ckpt.safetensors"
        shutil.copy(model, out)
    before = snapshot(str(out))
    listing = sorted(os.listdir(parent))
    rc, _, err = peak_rss([exe, "pull", "--store", bad, "-o", out, "--quiet"])
    assert rc != 0
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and part in lines[0], err
    assert snapshot(str(out)) == before
    assert sorted(os.listdir(parent)) == listing  # no temporary left beside OUT


CHILD = os.path.join(os.path.dirname(__file__), "subscriber_memory_child.py")


def subscriber_child(store, model):
    proc = subprocess.run([sys.executable, CHILD, str(store), str(model)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_subscriber_anchor_streams_with_memory_bounded_by_parts(published):
    _, model, store = published
    r = subscriber_child(store, model)
    assert r["error"] is None, r["error"]
    assert r["equal_to_model"] and r["version"] == 1
    assert r["extra"] <= 2 * PART, f"the anchor load peaked {r['extra'] / 1e6:.1f} MB above the weights: more than 2 parts"


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_bad_part_mid_anchor_leaves_the_subscribers_weights_every_byte(published, tmp_path, how):
    _, model, store = published
    bad, part = broken_store(store, tmp_path, how)
    r = subscriber_child(bad, model)
    assert r["error"] and part in r["error"], r["error"]
    assert r["unchanged"], "weights changed by an anchor that failed part way"
    assert r["version"] is None
