"""Shard-local publish with real processes (torch.distributed, gloo): every trainer rank publishes
its own shard, the group commits each version once, and a single-process DeltaSubscriber and the
CLI's `pull` stay bit-identical to the gathered weights at every version. Also: a rank killed
mid-publish makes nothing visible and a restarted group publishes on; ranks disagreeing about a
tensor's shape are refused on every rank."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import deltasync

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world, *args, timeout=300):
    """Runs sharded_rank.py on `world` ranks; returns [(returncode, output)] in rank order."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", DELTASYNC_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "sharded_rank.py"), *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return [(p.wait(timeout=timeout), p.communicate()[0]) for p in procs]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def check_followers(store, out_dir: Path, versions, run_cli, tmp_path):
    """A DeltaSubscriber and a CLI pull, version by version, against the gathered weights."""
    first = torch.load(out_dir / f"v{versions[0]}.pt")
    model = {name: torch.zeros_like(t) for name, t in first.items()}
    sub = deltasync.DeltaSubscriber(model, store=store)
    pulled = tmp_path / "pulled.safetensors"
    plans = []
    for v in versions:
        want = torch.load(out_dir / f"v{v}.pt")
        assert sub.update(v) == v
        plans.append(sub.last_report.anchor)
        for name, t in want.items():
            assert torch.equal(bits(model[name]), bits(t)), f"subscriber: {name} at version {v}"
        run_cli("pull", "--store", store, "-o", pulled, "--version", v, "--quiet")
        got = load_file(str(pulled))
        for name, t in want.items():
            assert torch.equal(bits(got[name].view(t.shape)), bits(t)), f"pull: {name} at version {v}"
    return plans


@pytest.mark.parametrize("mode,world", [("fsdp2", 2), ("fsdp2", 4), ("dtensor", 2), ("dtensor", 4)])
def test_every_rank_publishes_its_shard_and_followers_stay_bit_identical(mode, world, tmp_path, run_cli):
    store = f"file://{tmp_path}/store"
    out = tmp_path / "out"
    out.mkdir()
    results = launch(world, mode, store, out, 1, 6)
    for rank, (rc, text) in enumerate(results):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{text}"
    outcomes = [json.loads((out / f"v{v}.json").read_text()) for v in range(1, 7)]
    assert all(o["committed"] for o in outcomes)
    assert [o["anchor"] for o in outcomes] == [True, False, False, False, True, False]
    assert all(o["changed_elements"] > 0 for o in outcomes[1:]), outcomes
    # No tensor data crosses between ranks: what the gather moves is references and digests.
    assert all(o["gathered_bytes"] < 64 * 1024 for o in outcomes), outcomes
    manifest = json.loads((tmp_path / "store" / "manifests" / f"{2:020d}.json").read_text())
    assert manifest["delta"] is None and len(manifest["delta_parts"]) >= 2
    plans = check_followers(store, out, list(range(1, 7)), run_cli, tmp_path)
    assert plans[1:4] == [None, None, None], "versions 2..4 are reached by their deltas"


def test_the_trl_callback_publishes_an_fsdp2_model_shard_locally(tmp_path, run_cli):
    store = f"file://{tmp_path}/store"
    out = tmp_path / "out"
    out.mkdir()
    results = launch(2, "trl", store, out, 1, 4)
    for rank, (rc, text) in enumerate(results):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{text}"
    manifest = json.loads((tmp_path / "store" / "manifests" / f"{2:020d}.json").read_text())
    assert len(manifest["delta_parts"]) == 2
    check_followers(store, out, list(range(1, 5)), run_cli, tmp_path)


def test_a_rank_killed_mid_publish_makes_nothing_visible_and_a_restarted_group_publishes_on(tmp_path, run_cli):
    store = f"file://{tmp_path}/store"
    out = tmp_path / "out"
    out.mkdir()
    results = launch(2, "fsdp2", store, out, 1, 4, 3)
    assert results[1][0] == -9, results[1][1]
    assert results[0][0] != 0  # rank 0 saw the gather fail: nothing committed
    manifests = sorted(p.name for p in (tmp_path / "store" / "manifests").iterdir())
    assert manifests == [f"{1:020d}.json", f"{2:020d}.json"], manifests
    assert (tmp_path / "store" / "LATEST").read_text() == "2\n"
    # Rank 1's part of version 3 reached the store, but no manifest names it.
    assert any(p.name.startswith(f"{3:020d}-") for p in (tmp_path / "store" / "deltas").iterdir())
    # A follower at version 2 ...
    first = torch.load(out / "v1.pt")
    model = {name: torch.zeros_like(t) for name, t in first.items()}
    sub = deltasync.DeltaSubscriber(model, store=store)
    assert sub.update() == 2
    # ... and the restarted group: its first version is an anchor, then deltas again.
    results = launch(2, "fsdp2", store, out, 4, 3)
    for rank, (rc, text) in enumerate(results):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{text}"
    assert sub.update() == 6
    want = torch.load(out / "v6.pt")
    for name, t in want.items():
        assert torch.equal(bits(model[name]), bits(t)), name
    check_followers(store, out, [4, 5, 6], run_cli, tmp_path)


def test_ranks_that_disagree_about_a_tensor_are_refused_on_every_rank(tmp_path):
    store = tmp_path / "store"
    results = launch(2, "mismatch", f"file://{store}", tmp_path, 1, 1)
    for rank, (rc, text) in enumerate(results):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{text}"
        refused = [line for line in text.splitlines() if line.startswith("REFUSED")]
        assert refused == ["REFUSED version 1: rank 1 reports tensor w as BF16[8, 5], rank 0 as BF16[8, 4]"], text
    assert not (store / "manifests").exists() or not any((store / "manifests").iterdir())
    assert not (store / "LATEST").exists()
