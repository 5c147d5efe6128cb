"""Checkpoint folders as transformers' save_pretrained writes them (a tiny random Llama, split
with max_shard_size into several shards plus model.safetensors.index.json) through every
command that takes a checkpoint: diff -> apply and publish -> pull reproduce the new weights bit
for bit in both delta layouts, apply keeps the shard files and the index, the result loads back
into transformers, and bad folders fail with one line naming the file and leave no output."""
import json
import os
import shutil
import sys

import pytest

import torch  # noqa: E402  (scripts/requirements.txt: always installed by scripts/test)
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

INDEX = "model.safetensors.index.json"


def tiny_llama(seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def save(model, folder):
    model.save_pretrained(folder, max_shard_size="60KB")
    return folder


def train_step(model, share=0.03, seed=1):
    """About `share` of every weight's elements move by one ulp, as an RL step moves them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            b = p.data.view(torch.int16)
            mask = torch.rand(b.shape, generator=g) < share
            b[mask] ^= 1


def tensors_of(path):
    """name -> tensor of a file or a folder (every shard)."""
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for name in st.keys():
                assert name not in out
                out[name] = st.get_tensor(name)
    return out


def assert_same_weights(a, b):
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype
        assert torch.equal(ta[name].view(torch.int16), tb[name].view(torch.int16)), name


@pytest.fixture
def folders(tmp_path):
    model = tiny_llama(0)
    base = save(model, tmp_path / "base")
    train_step(model)
    new = save(model, tmp_path / "new")
    shards = sorted(f for f in os.listdir(base) if f.endswith(".safetensors"))
    assert len(shards) >= 3 and (base / INDEX).exists()
    return base, new


@pytest.mark.parametrize("fmt", ["trl", "compact"])
def test_diff_apply_on_folders_reproduces_new_with_the_same_split(run_cli, folders, tmp_path, fmt):
    base, new = folders
    delta = tmp_path / "delta.safetensors"
    run_cli("diff", base, new, "-o", delta, "--format", fmt)
    out = tmp_path / "out"
    proc = run_cli("apply", base, delta, "-o", out)
    assert "digests verified" in proc.stdout
    assert_same_weights(out, new)
    # Same shard files, byte for byte (save_pretrained wrote both folders alike), index unchanged.
    assert sorted(os.listdir(out)) == sorted(os.listdir(base))
    assert (out / INDEX).read_bytes() == (base / INDEX).read_bytes()
    for f in os.listdir(new):
        if f.endswith(".safetensors"):
            assert (out / f).read_bytes() == (new / f).read_bytes(), f
    # Applying again over an existing folder replaces it whole.
    run_cli("apply", base, delta, "-o", out)
    assert_same_weights(out, new)
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.model.embed_tokens.weight.view(torch.int16),
                       tensors_of(new)["model.embed_tokens.weight"].view(torch.int16))


def test_diff_matches_tensors_by_name_across_splits(run_cli, folders, tmp_path):
    base, new = folders
    single = tmp_path / "new-single.safetensors"
    from safetensors.torch import save_file
    save_file(tensors_of(new), single, metadata={"format": "pt"})
    delta = tmp_path / "delta.safetensors"
    run_cli("diff", base, single, "-o", delta)
    run_cli("apply", base, delta, "-o", tmp_path / "out")
    assert_same_weights(tmp_path / "out", new)


def test_verify_and_inspect_a_folder(run_cli, folders, tmp_path):
    base, _ = folders
    proc = run_cli("verify", base, "--cpu")
    assert len(proc.stdout.strip().splitlines()) == len(tensors_of(base))
    assert "records no digests" in proc.stderr
    info = run_cli("inspect", base).stdout
    n_shards = len([f for f in os.listdir(base) if f.endswith(".safetensors")])
    assert "kind: checkpoint folder" in info and f"shards: {n_shards} ({INDEX})" in info
    assert f"tensors: {len(tensors_of(base))}" in info


@pytest.mark.parametrize("fmt", ["trl", "compact"])
def test_publish_and_pull_folders_bit_exact(run_cli, folders, tmp_path, fmt):
    base, new = folders
    store = f"file://{tmp_path / 'store'}"
    state = tmp_path / "state"
    run_cli("publish", base, "--store", store, "--version", 1, "--state", state, "--format", fmt, "--quiet")
    replica = tmp_path / "replica"  # a new folder name: written as a folder
    run_cli("pull", "--store", store, "-o", replica, "--max-shard-bytes", 100_000, "--quiet")
    assert_same_weights(replica, base)
    assert (replica / INDEX).exists() and len([f for f in os.listdir(replica) if f.endswith(".safetensors")]) > 1
    assert "OK:" in run_cli("verify", replica).stdout  # each shard records its tensors' digests

    run_cli("publish", new, "--store", store, "--version", 2, "--state", state, "--format", fmt, "--quiet")
    split_before = sorted(os.listdir(replica))
    proc = run_cli("pull", "--store", store, "-o", replica, "--quiet")
    assert "version 1 -> 2 via 1 delta" in proc.stdout
    assert_same_weights(replica, new)
    assert sorted(os.listdir(replica)) == split_before  # the folder keeps its split

    # A replica that is a copy of the trainer's folder keeps save_pretrained's split and index.
    hf_copy = tmp_path / "hf-copy"
    shutil.copytree(base, hf_copy)
    run_cli("pull", "--store", store, "-o", hf_copy, "--quiet")
    assert_same_weights(hf_copy, new)
    assert (hf_copy / INDEX).read_bytes() == (base / INDEX).read_bytes()
    transformers.LlamaForCausalLM.from_pretrained(hf_copy)

    single = tmp_path / "replica.safetensors"  # -o FILE: one file
    run_cli("pull", "--store", store, "-o", single, "--quiet")
    assert os.path.isfile(single)
    assert_same_weights(single, new)


def break_missing_shard(folder):
    victim = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[1]
    os.remove(folder / victim)
    return victim, "which does not exist"


def break_duplicate_tensor(folder):
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    with safe_open(folder / shards[0], "pt") as st:
        name = next(iter(st.keys()))
        dup = {name: st.get_tensor(name)}
    with safe_open(folder / shards[1], "pt") as st:
        dup.update({k: st.get_tensor(k) for k in st.keys()})
    from safetensors.torch import save_file
    save_file(dup, folder / shards[1], metadata={"format": "pt"})
    return name, "is in both"


def break_index_names_absent_file(folder):
    index = json.loads((folder / INDEX).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-99999-of-99999.safetensors"
    (folder / INDEX).write_text(json.dumps(index))
    return "model-99999-of-99999.safetensors", "which does not exist"


def break_shard_not_in_index(folder):
    shutil.copy(folder / sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0], folder / "extra.safetensors")
    return "extra.safetensors", "shard not named in"


def break_total_size(folder):
    index = json.loads((folder / INDEX).read_text())
    index["metadata"]["total_size"] += 2
    (folder / INDEX).write_text(json.dumps(index))
    return "total_size", "bytes of tensors"


def break_index_json(folder):
    (folder / INDEX).write_text("{not json")
    return INDEX, "not a JSON object"


@pytest.mark.parametrize("breaker", [break_missing_shard, break_duplicate_tensor, break_index_names_absent_file,
                                     break_shard_not_in_index, break_total_size, break_index_json])
def test_bad_folders_fail_with_one_line_and_no_output(run_cli, folders, tmp_path, breaker):
    base, new = folders
    delta = tmp_path / "delta.safetensors"
    run_cli("diff", base, new, "-o", delta)
    broken = tmp_path / "broken"
    shutil.copytree(base, broken)
    named, reason = breaker(broken)
    store = f"file://{tmp_path / 'store'}"
    attempts = {
        "diff": (("diff", broken, new, "-o", tmp_path / "d2.safetensors"), tmp_path / "d2.safetensors"),
        "diff-new": (("diff", base, broken, "-o", tmp_path / "d3.safetensors"), tmp_path / "d3.safetensors"),
        "apply": (("apply", broken, delta, "-o", tmp_path / "out"), tmp_path / "out"),
        "verify": (("verify", broken), None),
        "inspect": (("inspect", broken), None),
        "publish": (("publish", broken, "--store", store, "--version", 1, "--quiet"), tmp_path / "store" / "LATEST"),
    }
    for what, (args, output) in attempts.items():
        proc = run_cli(*args, check=False)
        line = proc.stderr.strip()
        assert proc.returncode != 0, what
        assert "\n" not in line, (what, line)
        assert str(named) in line and reason in line, (what, line)
        if output is not None:
            assert not os.path.exists(output), what
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_failed_apply_to_a_folder_leaves_the_old_output(run_cli, folders, tmp_path):
    base, new = folders
    delta = tmp_path / "delta.safetensors"
    run_cli("diff", base, new, "-o", delta)
    out = tmp_path / "out"
    shutil.copytree(base, out)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    # The delta applied to NEW is applied to the wrong base: refused before OUT changes.
    proc = run_cli("apply", new, delta, "-o", out, check=False)
    assert proc.returncode == 1 and "expects base" in proc.stderr
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]
