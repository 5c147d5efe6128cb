"""A restarted sharded trainer group resumes from the store (ShardedDeltaPublisher(resume=True)),
with real processes (torch.distributed, gloo): every rank recovers its own shard's shadow at the
version the new epoch starts from, reading only the parts that overlap its placements, and the
group's next version is a delta -- no anchor, no re-upload of the model. A single-process
DeltaSubscriber and the CLI's `pull` stay bit-identical at every version, across a change of world
size too; a tampered part makes every rank refuse with the same one line and nothing visible."""
import json
from pathlib import Path

import pytest

from test_sharded_publish import check_followers, launch, lines_of, store_bytes


def manifest(root: Path, version: int) -> dict:
    return json.loads((root / "manifests" / f"{version:020d}.json").read_text())


def resumed(results) -> list[dict]:
    """Every rank's RESUMED report (exactly one per rank)."""
    lines = lines_of(results, "RESUMED")
    assert all(len(r) == 1 for r in lines), lines
    return [json.loads(r[0]) for r in lines]


def publish_three(tmp_path, world, mode="fsdp2"):
    root, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    store = f"file://{root}"
    for rank, (rc, text) in enumerate(launch(world, mode, store, out, 1, 3)):
        assert rc == 0, f"rank {rank} exited with {rc}:\n{text}"
    assert [bool(manifest(root, v)["anchor_parts"]) for v in (1, 2, 3)] == [True, False, False]
    return root, store, out


def test_a_restarted_group_resumes_its_shards_from_the_store_and_publishes_a_delta(tmp_path, run_cli):
    root, store, out = publish_three(tmp_path, 2)
    # The restarted trainers load their own checkpoint of version 3 and publish it as version 4
    # before training on: a shadow recovered bit-exactly makes that an empty delta.
    results = launch(2, "resume", store, out, 4, 2, env={"DS_CHECKPOINT": "1"})
    reports = resumed(results)
    assert [r["resumed_version"] for r in reports] == [3, 3]
    for r in reports:
        # Its own anchor slices and its own two delta parts, each read whole (SHA-256 checked),
        # after the tensor tables of both anchor parts: nothing of the other rank's parts.
        assert (r["whole_objects"], r["ranged_reads"], r["header_reads"]) == (3, 0, 4), r
    assert (root / "LATEST").read_text() == "5\nrun unnamed\nepoch 2\nsince 3\n"
    v4, v5 = manifest(root, 4), manifest(root, 5)
    for m, base in ((v4, 3), (v5, 4)):
        assert m["anchor_parts"] == [] and m["base_version"] == base, m
        assert m["delta"] is None and len(m["delta_parts"]) == 2, m
    assert v4["changed_elements"] == 0, "the recovered shadow differs from the store's version 3"
    assert v5["changed_elements"] > 0
    outcomes = {v: json.loads((out / f"v{v}.json").read_text()) for v in (1, 2, 4, 5)}
    assert not outcomes[4]["anchor"] and outcomes[4]["anchor_bytes"] == 0
    # What the restarted group uploaded is delta-sized, not the model again: an empty delta, then
    # one step's delta the size of the first group's (every element moves in an AdamW step of
    # this tiny model, so a step's delta file outweighs its anchor; bytes per element: see
    # benchmarks/sharded_resume.py).
    assert outcomes[4]["delta_bytes"] < outcomes[1]["anchor_bytes"], outcomes
    assert outcomes[5]["delta_bytes"] <= 1.25 * outcomes[2]["delta_bytes"], outcomes
    check_followers(store, out, [1, 2, 3, 4, 5], run_cli, tmp_path)


@pytest.mark.parametrize("before,after,checkpoint", [(4, 2, True), (2, 4, False)])
def test_a_group_of_another_world_size_resumes_from_the_parts_of_the_old_one(before, after, checkpoint, tmp_path, run_cli):
    root, store, out = publish_three(tmp_path, before)
    # With the trainers' checkpoint of version 3 the first delta is empty (every rank's shadow is
    # the store's bits); with fresh weights it carries the difference.
    results = launch(after, "resume", store, out, 4, 2, env={"DS_CHECKPOINT": "1" if checkpoint else "0"})
    reports = resumed(results)
    assert [r["resumed_version"] for r in reports] == [3] * after
    v4 = manifest(root, 4)
    assert v4["anchor_parts"] == [] and v4["base_version"] == 3 and len(v4["delta_parts"]) == after, v4
    assert (v4["changed_elements"] == 0) == checkpoint, v4
    everything = sum(p["size"] for p in manifest(root, 1)["anchor_parts"]) + sum(
        p["size"] for v in (2, 3) for p in manifest(root, v)["delta_parts"])
    for r in reports:
        assert r["bytes_read"] < everything, (r, everything)  # its own share, never the whole model
    if after > before:  # a new rank's shard is a small share of an old part: read by ranges
        assert any(r["ranged_reads"] > 0 for r in reports), reports
    check_followers(store, out, [1, 2, 3, 4, 5], run_cli, tmp_path)


def flip_byte(path: Path, at: int):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tamper,after", [("delta part", 2), ("anchor slice", 4)])
def test_a_tampered_part_is_refused_on_every_rank_and_nothing_becomes_visible(tamper, after, tmp_path):
    root, store, out = publish_three(tmp_path, 2)
    if tamper == "delta part":  # rank 1's part of version 3, read whole: its SHA-256 differs
        key = manifest(root, 3)["delta_parts"][1]["key"]
        flip_byte(root / key, -20)
        expected = f"resume from version 3: rank 1 failed: {store}/{key}: sha256 differs from the manifest's (corrupt object)"
    else:  # the last byte of old rank 0's anchor slices: new rank 0 reads that part whole (most of
        # it is its shard), new rank 1 the byte range of its rows (checked by the digests' sum)
        key = manifest(root, 1)["anchor_parts"][0]["key"]
        flip_byte(root / key, -1)
        expected = f"resume from version 3: rank 0 failed: {store}/{key}: sha256 differs from the manifest's (corrupt object)"
    before = store_bytes(root)
    results = launch(after, "resume", store, out, 4, 2)
    refused = lines_of(results, "REFUSED")
    assert all(len(r) == 1 for r in refused) and all(r == refused[0] for r in refused), refused
    assert refused[0][0].split(" ", 1)[1] == expected, refused
    after_bytes = store_bytes(root)
    # Only the claim moved LATEST to a new epoch; no version, no object of the refused group.
    assert (root / "LATEST").read_text() == "3\nrun unnamed\nepoch 2\nsince 3\n"
    assert {k: v for k, v in after_bytes.items() if k != "LATEST"} == {k: v for k, v in before.items() if k != "LATEST"}


def test_the_trl_callback_resumes_an_fsdp2_model_from_the_store(tmp_path, run_cli):
    root, store, out = publish_three(tmp_path, 2, mode="trl")
    results = launch(2, "trl-resume", store, out, 4, 2, env={"DS_CHECKPOINT": "1"})
    assert [r["resumed_version"] for r in resumed(results)] == [3, 3]
    v4 = manifest(root, 4)
    assert v4["anchor_parts"] == [] and v4["base_version"] == 3 and v4["changed_elements"] == 0, v4
    check_followers(store, out, [1, 2, 3, 4, 5], run_cli, tmp_path)
