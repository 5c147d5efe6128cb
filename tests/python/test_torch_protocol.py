"""The store protocol as DeltaPublisher and DeltaSubscriber speak it, end to end through a store:
object keys with fresh nonces, the exclusive manifest create and LATEST as a hint, verified
fetches refusing replaced objects or manifests naming keys outside the store, retention, and
a store that cannot list. (The protocol itself -- manifest JSON, strict parsing, catch-up
planning, retention rules -- is C++ and unit-tested in tests/test_protocol.cpp.)"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import deltasync

sys.path.insert(0, os.path.dirname(__file__))
from test_http_store import DavServer  # noqa: E402

NO_SIZE_ANCHORS = 1e9  # anchors by anchor_every only: these tests are about the chain's shape


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8)).to(torch.bfloat16)


def nudge(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        model[0].weight.view(torch.int16)[step % 16, :4] += 1


def bits_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x.detach().view(torch.int16), y.detach().view(torch.int16))
               for x, y in zip(a.parameters(), b.parameters()))


@pytest.fixture
def root(tmp_path):
    return tmp_path / "bucket"


@pytest.fixture
def store(root):
    return f"file://{root}"


def manifest_path(root: Path, version: int) -> Path:
    return root / "manifests" / f"{version:020d}.json"


def publish_chain(store: str, versions: int, **options) -> torch.nn.Module:
    """Versions 0..versions-1 of a model nudged a little each step; returns the trainer. Each
    version is uploaded on its own (max_pending above the number of versions: none merged)."""
    trainer = make_model(0)
    options = {"max_pending": 16, **options}
    with deltasync.DeltaPublisher(trainer, store=store, anchor_share=NO_SIZE_ANCHORS, **options) as pub:
        for step in range(versions):
            if step:
                nudge(trainer, step)
            pub.publish(step)
    return trainer


def test_objects_are_stored_under_their_version_with_a_fresh_nonce_per_upload(store, root):
    publish_chain(store, 4, anchor_every=2)
    deltas = sorted(p.name for p in (root / "deltas").iterdir())
    anchors = sorted(str(p.relative_to(root / "anchors")) for p in (root / "anchors").rglob("*.safetensors"))
    assert [re.fullmatch(r"(\d{20})-[0-9a-f]{12}\.safetensors", n).group(1) for n in deltas] == [f"{v:020d}" for v in (1, 2, 3)]
    assert [re.fullmatch(r"(\d{20})-[0-9a-f]{12}/part-00000\.safetensors", n).group(1) for n in anchors] == [f"{v:020d}" for v in (0, 2)]
    # One nonce per version's upload (its delta and anchor parts share it), never reused.
    nonces = {n[:20]: n[21:33] for n in deltas + anchors}
    assert len(set(nonces.values())) == len(nonces) == 4
    # Every object is named by its version's manifest, with its size and SHA-256.
    for v in range(4):
        m = json.loads(manifest_path(root, v).read_text())
        refs = ([m["delta"]] if m["delta"] else []) + m["anchor_parts"]
        assert refs and all((root / r["key"]).stat().st_size == r["size"] for r in refs)
        assert m["kind"] == {0: "anchor", 2: "anchor+delta"}.get(v, "delta")
        assert m["latest_anchor"] == (0 if v < 2 else 2)


def test_latest_is_a_hint_and_manifests_are_what_counts(store, root):
    trainer = publish_chain(store, 3, anchor_every=100)
    assert (root / "LATEST").read_text().splitlines()[0] == "2"  # rewritten after each manifest
    # A LATEST naming a version without a manifest (e.g. deleted by hand) is not trusted: the
    # folder store lists, and the newest manifest wins.
    (root / "LATEST").write_text("7\n")
    follower = make_model(1)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.poll() == 2
    assert sub.update() == 2 and bits_equal(trainer, follower)
    assert not sub.has_version(7)
    (root / "LATEST").write_text("two\n")
    with pytest.raises(deltasync.errors.BadDeltaError, match=r"bucket/LATEST: LATEST pointer 'two': not a decimal integer"):
        deltasync.DeltaSubscriber(make_model(1), store=store).poll()


def test_a_replaced_delta_is_refused_and_nothing_written(store, root):
    publish_chain(store, 2, anchor_every=100)
    follower = make_model(1)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.update(0) == 0
    delta = json.loads(manifest_path(root, 1).read_text())["delta"]
    data = bytearray((root / delta["key"]).read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, other bytes
    (root / delta["key"]).write_bytes(bytes(data))
    before = [p.detach().clone() for p in follower.parameters()]
    with pytest.raises(deltasync.errors.BadDeltaError, match=re.escape(delta["key"]) + ".*sha256 differs from the manifest's"):
        sub.update()
    assert all(torch.equal(a, b) for a, b in zip(before, follower.parameters()))
    assert sub.version == 0


def test_a_manifest_naming_a_key_outside_the_store_is_refused(store, root):
    publish_chain(store, 2, anchor_every=100)
    path = manifest_path(root, 1)
    m = json.loads(path.read_text())
    m["delta"]["key"] = "../escape.safetensors"
    path.write_text(json.dumps(m))
    follower = make_model(1)
    before = [p.detach().clone() for p in follower.parameters()]
    with pytest.raises(deltasync.errors.BadDeltaError, match=rf"manifests/{1:020d}\.json.*invalid object key"):
        deltasync.DeltaSubscriber(follower, store=store).update(1)
    assert all(torch.equal(a, b) for a, b in zip(before, follower.parameters()))


def test_publisher_retention_keeps_the_newest_anchors_and_readers_follow(store, root):
    trainer = publish_chain(store, 10, anchor_every=3, keep_anchors=2)
    # anchors at 0, 3, 6, 9: the newest two are 6 and 9, so versions 0..5 are gone
    manifests = sorted((root / "manifests").iterdir())
    assert [int(p.stem) for p in manifests] == [6, 7, 8, 9]
    leftovers = [p.name for p in (root / "deltas").iterdir()] + [p.name for p in (root / "anchors").iterdir()]
    assert all(int(name[:20]) >= 6 for name in leftovers)
    follower = make_model(1)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.update(8) == 8 and sub.last_report.anchor == 6 and sub.last_report.deltas == [7, 8]
    assert sub.update() == 9
    assert bits_equal(trainer, follower)


def test_publisher_and_subscriber_over_http_without_listing():
    """The http(s) store cannot list: readers find versions through LATEST and manifests by
    name, and the publisher's retention is skipped (with a note) instead of failing the upload."""
    server = DavServer()
    try:
        trainer, follower = make_model(0), make_model(1)
        sub = deltasync.DeltaSubscriber(follower, store=server.url)
        assert sub.poll() is None
        notes = []
        with deltasync.DeltaPublisher(trainer, store=server.url, anchor_every=2, keep_anchors=1,
                                      anchor_share=NO_SIZE_ANCHORS, log=notes.append) as pub:
            for step in range(5):
                if step:
                    nudge(trainer, step)
                pub.publish(step)
                pub.flush()
                assert sub.poll() == step
                assert sub.update() == step
                assert bits_equal(trainer, follower)
        assert [s.version for s in pub.stats if s.visible] == [0, 1, 2, 3, 4]
        skipped = [n for n in notes if n.startswith("retention skipped")]
        assert len(skipped) == 3 and all("listing is not supported" in n for n in skipped), notes  # anchors 0, 2, 4
        assert "/weights/run-1/manifests/" + f"{0:020d}.json" in server.objects  # nothing deleted
    finally:
        server.stop()
