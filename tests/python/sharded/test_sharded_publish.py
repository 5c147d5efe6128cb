"""Shard-local publish with real processes (torch.distributed, gloo): every trainer rank publishes
its own shard, the group commits each version once, and a single-process DeltaSubscriber and the
CLI's `pull` stay bit-identical to the gathered weights at every version. Also: a rank killed
mid-publish makes nothing visible and a restarted group publishes on; ranks disagreeing about a
tensor's shape, ranks whose placements overlap and a part missing from the store are refused on
every rank with one line. Fencing: another run's group is refused on every rank
and writes nothing, taking over is explicit, a restarted group takes a new epoch and the old
group, still alive, is refused with nothing of it visible."""
import json
import os
import socket
import subprocess
import sys
import time
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


def start(world, *args, env=None, script=HERE / "sharded_rank.py"):
    """Starts `script` (sharded_rank.py) on `world` ranks with torch.distributed's env:// variables
    (extra environment `env`); returns the processes."""
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), OMP_NUM_THREADS="1", DELTASYNC_THREADS="1", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs, timeout=300):
    return [(p.wait(timeout=timeout), p.communicate()[0]) for p in procs]


def launch(world, *args, timeout=300, env=None, script=HERE / "sharded_rank.py"):
    """Runs `script` on `world` ranks; returns [(returncode, output)] in rank order."""
    return finish(start(world, *args, env=env, script=script), timeout)


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
    # No tensor data crosses between ranks: what the gather moves is references and hashes (a few
    # hundred bytes a rank: rank 0 derives the placements from the DTensors' rules), what the
    # reduce sums the digest partials (16 B a tensor); no table is gathered.
    assert all(o["gathered_bytes"] < 1024 * world for o in outcomes), outcomes
    assert all(o["table_bytes"] == 0 for o in outcomes), outcomes
    tensors = len(torch.load(out / "v1.pt"))
    assert all(o["reduce_bytes"] == 16 * tensors for o in outcomes), outcomes
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
    assert (tmp_path / "store" / "LATEST").read_text() == "2\nrun unnamed\nepoch 1\nsince none\n"
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


def refusals(results):
    """Every rank's REFUSED lines and its outcome, after checking that it exited cleanly."""
    out = []
    for rank, (rc, text) in enumerate(results):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{text}"
        refused = [line[len("REFUSED "):] for line in text.splitlines() if line.startswith("REFUSED")]
        outcome = [json.loads(line[len("OUTCOME "):]) for line in text.splitlines() if line.startswith("OUTCOME")]
        out.append((refused, outcome[0] if outcome else None))
    return out


def nothing_published(store: Path):
    assert not (store / "manifests").exists() or not any((store / "manifests").iterdir())
    # The group's claim is all there is: no version.
    assert (store / "LATEST").read_text() == "none\nrun unnamed\nepoch 1\nsince none\n"


def test_ranks_that_disagree_about_a_tensor_are_refused_on_every_rank(tmp_path):
    store = tmp_path / "store"
    got = refusals(launch(2, "mismatch", f"file://{store}", tmp_path, 1, 1))
    for refused, _ in got:
        assert refused == ["version 1: rank 1 reports tensor w as BF16[8, 5], rank 0 as BF16[8, 4]"], got
    # The receipts' table hashes differed, so rank 0 gathered the tables to name the rank and tensor.
    assert got[0][1]["table_bytes"] > 0
    nothing_published(store)


def test_ranks_whose_placements_overlap_are_refused_on_every_rank(tmp_path):
    store = tmp_path / "store"
    got = refusals(launch(2, "overlap", f"file://{store}", tmp_path, 1, 1))
    for refused, _ in got:
        assert refused == ["version 1: tensor w: rank 0 and rank 1 overlap at position 8"], got
    # Explicit offsets travel in the receipts: no second round.
    assert got[0][1]["table_bytes"] == 0
    nothing_published(store)


def test_a_part_missing_from_the_store_is_refused_on_every_rank(tmp_path):
    store = tmp_path / "store"
    got = refusals(launch(2, "missing", f"file://{store}", tmp_path, 1, 1))
    assert got[0][0] == got[1][0] and len(got[0][0]) == 1, got
    line = got[0][0][0]
    assert line.startswith("version 1: part ") and line.endswith(" of rank 1 is missing from the store"), line
    nothing_published(store)


def store_bytes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def lines_of(results, tag):
    """Each rank's lines starting with `tag`, after checking that every rank exited cleanly."""
    out = []
    for rank, (rc, text) in enumerate(results):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{text}"
        out.append([line[len(tag) + 1:] for line in text.splitlines() if line.startswith(tag + " ")])
    return out


def follow(store, out: Path, version):
    """A single-process follower at `version`, bit-identical to what the group saved of it."""
    want = torch.load(out / f"v{version}.pt")
    model = {name: torch.zeros_like(t) for name, t in want.items()}
    sub = deltasync.DeltaSubscriber(model, store=store)
    assert sub.update() == version
    for name, t in want.items():
        assert torch.equal(bits(model[name]), bits(t)), f"{name} at version {version}"


def fenced_dirs(tmp_path, *groups):
    """The store's folder, its URL and an output folder per group."""
    outs = [tmp_path / g for g in groups]
    for out in outs:
        out.mkdir()
    return tmp_path / "store", f"file://{tmp_path / 'store'}", *outs


def test_another_runs_group_is_refused_on_every_rank_and_taking_over_is_explicit(tmp_path):
    root, store, out_a, out_b = fenced_dirs(tmp_path, "a", "b")
    fences = lines_of(launch(2, "fenced", store, out_a, 1, 2, env={"DS_RUN_ID": "a"}), "FENCE")
    assert [json.loads(f[0]) for f in fences] == [{"run_id": "a", "epoch": 1, "since": None}] * 2
    assert (root / "LATEST").read_text() == "2\nrun a\nepoch 1\nsince none\n"  # the group's fence kept
    before = store_bytes(root)
    refused = lines_of(launch(2, "fenced", store, out_b, 3, 2, env={"DS_RUN_ID": "b"}), "REFUSED")
    assert refused[0] == refused[1] and len(refused[0]) == 1, refused
    assert refused[0][0].startswith("InvalidArgumentError "), refused
    assert "the store is published by run a (epoch 1); refusing to publish run b into it" in refused[0][0]
    assert store_bytes(root) == before, "a refused group wrote into the store"
    fences = lines_of(launch(2, "fenced", store, out_b, 3, 2, env={"DS_RUN_ID": "b", "DS_TAKE_OVER": "1"}), "FENCE")
    assert [json.loads(f[0]) for f in fences] == [{"run_id": "b", "epoch": 2, "since": 2}] * 2
    assert (root / "LATEST").read_text() == "4\nrun b\nepoch 2\nsince 2\n"
    follow(store, out_b, 4)


def test_a_restarted_group_takes_a_new_epoch_and_the_old_group_still_alive_is_refused(tmp_path):
    root, store, out_old, out_new = fenced_dirs(tmp_path, "old", "new")
    old = start(2, "fenced", store, out_old, 1, 3, 3, env={"DS_RUN_ID": "r"})  # pauses before version 3
    deadline = time.monotonic() + 240
    while not all((out_old / f"paused-{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in old), finish(old)
        time.sleep(0.2)
    assert (root / "LATEST").read_text() == "2\nrun r\nepoch 1\nsince none\n"
    # The restart, while the old group is only partitioned: a new epoch from version 2.
    fences = lines_of(launch(2, "fenced", store, out_new, 3, 2, env={"DS_RUN_ID": "r"}), "FENCE")
    assert [json.loads(f[0]) for f in fences] == [{"run_id": "r", "epoch": 2, "since": 2}] * 2
    assert (root / "LATEST").read_text() == "4\nrun r\nepoch 2\nsince 2\n"
    before = store_bytes(root)
    (out_old / "resume").touch()
    refused = lines_of(finish(old), "REFUSED")
    assert len(refused[0]) == 1 and len(refused[1]) == 1, refused
    for line in (refused[0][0], refused[1][0]):
        assert line.startswith("ShardedFencedError version 3: rank "), line
        assert "run r (epoch 1) was fenced off: the store is now run r (epoch 2)" in line
    assert refused[0] == refused[1]
    assert store_bytes(root) == before, "the fenced-off group wrote into the store"
    # A follower sees only the new epoch's versions (its version 3 and 4), bit-identical.
    follow(store, out_new, 4)
