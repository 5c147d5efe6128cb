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
import struct
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from pull_memory import mutate_model, peak_rss, publish_sliced, write_model  # noqa: E402

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


# --- deltas after the anchor: pull streams them tensor by tensor (host/cli/checkpoint_receiver.hpp)

@pytest.fixture(scope="module")
def with_deltas(published, tmp_path_factory):
    """A copy of `published`'s store grown by versions 2 and 3, deltas that change 0.2% of the
    elements (spread over every tensor); returns (exe, {version: model file}, store, the deltas'
    bytes). Pull holds the deltas it applies (fetched, then one decoded at a time: 12 bytes a
    change), which its bound below allows for on top of the two parts."""
    exe, model, store = published
    tmp = tmp_path_factory.mktemp("pull_memory_deltas")
    grown, state = tmp / "store", tmp / "state"
    shutil.copytree(store, grown)
    shutil.copytree(store.parent / "state", state)
    models = {1: model}
    for v in (2, 3):
        models[v] = tmp / f"model-{v}.safetensors"
        mutate_model(str(models[v - 1]), str(models[v]), 0.002, seed=v)
        rc, _, err = peak_rss([exe, "publish", models[v], "--store", grown, "--version", v, "--state", state, "--quiet"])
        assert rc == 0, err
    deltas = sum(os.path.getsize(p) for p in glob.glob(str(grown / "deltas" / "*")))
    return exe, models, grown, deltas


def assert_bits_of(model, out):
    want, got = tensors(str(model)), tensors(str(out))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.parametrize("out_name", ["replica", "replica.safetensors"])
def test_pull_of_anchor_and_deltas_peaks_within_parts(with_deltas, tmp_path, out_name):
    exe, models, store, deltas = with_deltas
    _, idle, _ = peak_rss([exe, "pull"])
    out = tmp_path / out_name
    rc, peak, err = peak_rss([exe, "pull", "--store", store, "-o", out, "--max-shard-bytes", 50 * 10**6])
    assert rc == 0, err
    assert "plan: anchor 1 + 2 deltas" in err, err
    extra = peak - idle
    assert extra <= 2 * PART + 4 * deltas, f"pull with deltas peaked {extra / 1e6:.1f} MB above idle: more than 2 parts + 4x the deltas"
    assert_bits_of(models[3], out)
    check = peak_rss([exe, "verify", out])
    assert check[0] == 0, check[2]


@pytest.mark.parametrize("out_name", ["replica", "replica.safetensors"])
def test_pull_of_deltas_onto_an_existing_out_peaks_within_parts(with_deltas, tmp_path, out_name):
    exe, models, store, deltas = with_deltas
    out = tmp_path / out_name
    rc, _, err = peak_rss([exe, "pull", "--store", store, "-o", out, "--version", 1, "--max-shard-bytes", 50 * 10**6, "--quiet"])
    assert rc == 0, err
    if out_name == "replica":
        (out / "config.json").write_text("{}")  # carried over by every rewrite
    _, idle, _ = peak_rss([exe, "pull"])
    rc, peak, err = peak_rss([exe, "pull", "--store", store, "-o", out])
    assert rc == 0, err
    assert "plan: 2 deltas" in err, err  # onto OUT, no anchor
    extra = peak - idle
    assert extra <= 2 * PART + 4 * deltas, f"pull of deltas peaked {extra / 1e6:.1f} MB above idle: more than 2 parts + 4x the deltas"
    assert_bits_of(models[3], out)
    if out_name == "replica":
        assert len(glob.glob(str(out / "*.safetensors"))) == 6 and (out / "config.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == [out_name]  # no temporary left beside OUT
    check = peak_rss([exe, "verify", out])
    assert check[0] == 0, check[2]


def test_out_whose_bits_differ_from_its_version_is_rebuilt_from_the_anchor(with_deltas, tmp_path):
    """OUT at version 1 with one flipped bit (its header intact): the audit reads OUT's bits, so
    the deltas are not applied onto it; the anchor and the deltas rebuild it, bit-exact."""
    exe, models, store, deltas = with_deltas
    out = tmp_path / "replica.safetensors"
    rc, _, err = peak_rss([exe, "pull", "--store", store, "-o", out, "--version", 1, "--quiet"])
    assert rc == 0, err
    with open(out, "r+b") as f:
        f.seek(os.path.getsize(out) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    _, idle, _ = peak_rss([exe, "pull"])
    rc, peak, err = peak_rss([exe, "pull", "--store", store, "-o", out])
    assert rc == 0, err
    assert "local weights do not match version 1" in err, err
    assert peak - idle <= 2 * PART + 4 * deltas
    assert_bits_of(models[3], out)


def test_bad_delta_leaves_out_every_byte(with_deltas, tmp_path):
    """Version 3's delta corrupted: the catch-up fails (and so does the recovery, whose only
    anchor needs that delta too); OUT, at version 1, stays as it was."""
    exe, models, store, deltas = with_deltas
    bad = tmp_path / "store"
    shutil.copytree(store, bad)
    (delta,) = glob.glob(str(bad / "deltas" / "00000000000000000003-*.safetensors"))
    with open(delta, "r+b") as f:
        f.seek(os.path.getsize(delta) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    parent = tmp_path / "out"
    parent.mkdir()
    out = parent / "ckpt"
    rc, _, err = peak_rss([exe, "pull", "--store", store, "-o", out, "--version", 1, "--quiet"])
    assert rc == 0, err
    before = snapshot(str(out))
    rc, _, err = peak_rss([exe, "pull", "--store", bad, "-o", out, "--quiet"])
    assert rc != 0
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and "sha256" in lines[0], err
    assert snapshot(str(out)) == before
    assert sorted(os.listdir(parent)) == ["ckpt"]


# --- anchors of slices (a shard-local publish): streamed a group of tensors at a time
# (host/sync/slice_anchor_stream.hpp)

RANKS = 32  # one part per rank: parts of 8 MB, the model 32x a part


@pytest.fixture(scope="module")
def sliced(published, tmp_path_factory):
    exe, model, _ = published
    store = tmp_path_factory.mktemp("pull_memory_sliced") / "store"
    publish_sliced(str(model), str(store), RANKS)
    parts = sorted(glob.glob(str(store / "anchors" / "*" / "*.safetensors")))
    assert len(parts) == RANKS, parts
    return exe, model, store


def test_pull_of_a_slice_anchor_peaks_within_parts(sliced, tmp_path):
    exe, model, store = sliced
    _, idle, _ = peak_rss([exe, "pull"])
    out = tmp_path / "replica"
    rc, peak, err = peak_rss([exe, "pull", "--store", store, "-o", out, "--max-shard-bytes", 50 * 10**6, "--quiet"])
    assert rc == 0, err
    extra = peak - idle
    assert extra <= 2 * PART, f"pull of a slice anchor peaked {extra / 1e6:.1f} MB above idle: more than 2 parts of {PART / 1e6:.0f} MB"
    assert_bits_of(model, out)
    check = peak_rss([exe, "verify", out])
    assert check[0] == 0, check[2]


def test_subscriber_streams_a_slice_anchor_within_parts(sliced):
    _, model, store = sliced
    r = subscriber_child(store, model)
    assert r["error"] is None, r["error"]
    assert r["equal_to_model"] and r["version"] == 1
    assert r["extra"] <= 2 * PART, f"the slice anchor load peaked {r['extra'] / 1e6:.1f} MB above the weights: more than 2 parts"


def swap_two_slices(part):
    """The bytes of a part's first two tensors (same sizes) trade places, its tensor table as it
    was: the table now disagrees with the bytes."""
    data = bytearray(open(part, "rb").read())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    (a0, a1), (b0, b1) = header[a]["data_offsets"], header[b]["data_offsets"]
    assert a1 - a0 == b1 - b0
    start = 8 + n
    data[start + a0:start + a1], data[start + b0:start + b1] = data[start + b0:start + b1], data[start + a0:start + a1]
    with open(part, "wb") as f:
        f.write(data)
    return a


def broken_sliced_store(store, tmp_path, how):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    parts = sorted(glob.glob(str(copy / "anchors" / "*" / "*.safetensors")))
    middle = parts[len(parts) // 2]
    if how == "missing":
        os.remove(middle)
    elif how == "tampered":
        with open(middle, "r+b") as f:
            f.seek(os.path.getsize(middle) - 4096)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
    else:  # "table": the part's table disagrees with its bytes; the manifest names the new part
        old = hashlib.sha256(open(middle, "rb").read()).hexdigest()
        swap_two_slices(middle)
        new = hashlib.sha256(open(middle, "rb").read()).hexdigest()
        for manifest in glob.glob(str(copy / "**" / "*.json"), recursive=True):
            text = open(manifest).read()
            if old in text:
                open(manifest, "w").write(text.replace(old, new))
    return copy, os.path.basename(middle)


@pytest.mark.parametrize("how", ["missing", "tampered", "table"])
def test_bad_slice_anchor_part_leaves_out_every_byte(sliced, tmp_path, how):
    exe, model, store = sliced
    bad, part = broken_sliced_store(store, tmp_path, how)
    parent = tmp_path / "out"
    parent.mkdir()
    out = parent / "ckpt"
    out.mkdir()
    shutil.copy(model, out / "model.safetensors")
    before = snapshot(str(out))
    rc, _, err = peak_rss([exe, "pull", "--store", bad, "-o", out, "--quiet"])
    assert rc != 0
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and part in lines[0], err
    if how != "missing":
        assert "does not match its recorded digest" in lines[0] or "sha256" in lines[0], lines[0]
    assert snapshot(str(out)) == before
    assert sorted(os.listdir(parent)) == ["ckpt"]


@pytest.mark.parametrize("how", ["missing", "tampered"])
def test_bad_slice_anchor_part_leaves_the_subscribers_weights_every_byte(sliced, tmp_path, how):
    _, model, store = sliced
    bad, part = broken_sliced_store(store, tmp_path, how)
    r = subscriber_child(bad, model)
    assert r["error"] and part in r["error"], r["error"]
    assert r["unchanged"], "weights changed by a slice anchor that failed part way"
    assert r["version"] is None
