"""The Python package's store protocol is the C++ library's (torch.ops.deltasync.protocol_*,
torch.classes.deltasync.Catalog): manifests built and checked in C++, verified fetches,
catch-up planning and retention driven from the Python publisher."""
from __future__ import annotations

import json

import pytest
import torch

import deltasync
from deltasync._protocol import Catalog, Manifest, ObjectRef, commit_version, delta_key, fetch_verified, new_nonce
from deltasync._store import open_store


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8)).to(torch.bfloat16)


def nudge(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        model[0].weight.view(torch.int16)[step % 16, :4] += 1


@pytest.fixture
def store(tmp_path):
    return f"file://{tmp_path / 'bucket'}"


def test_keys_and_nonces_come_from_the_cpp_protocol():
    nonce = new_nonce()
    assert len(nonce) == 12 and all(c in "0123456789abcdef" for c in nonce)
    assert new_nonce() != nonce
    assert delta_key(7, nonce) == f"deltas/{7:020d}-{nonce}.safetensors"


def test_manifest_the_cpp_reader_would_refuse_is_not_written(store):
    s = open_store(store)
    anchor = ObjectRef("anchors/x/part-00000.safetensors", 10, "0" * 64)
    bad = Manifest(version=3, anchor_parts=[anchor], latest_anchor=2)  # an anchor must name itself
    with pytest.raises(RuntimeError, match="latest_anchor"):
        commit_version(s, bad)
    with pytest.raises(RuntimeError, match="malformed sha256"):
        Manifest(version=3, anchor_parts=[ObjectRef("anchors/y", 1, "XYZ")], latest_anchor=3).to_json()
    assert not s.list("manifests/")
    good = Manifest(version=3, anchor_parts=[anchor], latest_anchor=3, digests={"w": "0123456789abcdef"})
    assert commit_version(s, good)
    assert not commit_version(s, Manifest(version=3, anchor_parts=[anchor], latest_anchor=3, digests={"w": "1" * 16}))
    assert s.get("LATEST") == b"3\n"
    text = s.get(f"manifests/{3:020d}.json").decode()
    assert json.loads(text)["kind"] == "anchor"
    assert Catalog(s).find(3) == Manifest(version=3, anchor_parts=[anchor], latest_anchor=3,
                                          digests={"w": "0123456789abcdef"},
                                          created_unix_ms=json.loads(text)["created_unix_ms"])


def test_fetch_verified_refuses_a_replaced_object(store):
    s = open_store(store)
    ref = ObjectRef.of("deltas/a.safetensors", b"payload")
    s.put(ref.key, b"payload")
    assert fetch_verified(s, ref) == b"payload"
    s.put(ref.key, b"paylaod")
    with pytest.raises(ValueError, match="sha256 differs"):
        fetch_verified(s, ref)


def test_publisher_retention_keeps_the_newest_anchors_and_readers_follow(store, tmp_path):
    trainer = make_model(0)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=3, keep_anchors=2, max_pending=16) as pub:
        for step in range(10):
            if step:
                nudge(trainer, step)
            pub.publish(step)
    # anchors at 0, 3, 6, 9: the newest two are 6 and 9, so versions 0..5 are gone
    manifests = sorted((tmp_path / "bucket" / "manifests").iterdir())
    assert [int(p.stem) for p in manifests] == [6, 7, 8, 9]
    leftovers = [p.name for p in (tmp_path / "bucket" / "deltas").iterdir()] + \
                [p.name for p in (tmp_path / "bucket" / "anchors").iterdir()]
    assert all(int(name[:20]) >= 6 for name in leftovers)
    follower = make_model(1)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.update(8) == 8 and sub.last_report.anchor == 6 and sub.last_report.deltas == [7, 8]
    assert sub.update() == 9
    for a, b in zip(trainer.parameters(), follower.parameters()):
        assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))


def test_publisher_and_subscriber_over_http_without_listing():
    """The http(s) store cannot list: readers find versions through LATEST and manifests by
    name, and the publisher's retention is skipped instead of failing the upload."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_http_store import DavServer

    server = DavServer()
    try:
        trainer, follower = make_model(0), make_model(1)
        sub = deltasync.DeltaSubscriber(follower, store=server.url)
        assert sub.poll() is None
        with deltasync.DeltaPublisher(trainer, store=server.url, anchor_every=2, keep_anchors=1) as pub:
            for step in range(5):
                if step:
                    nudge(trainer, step)
                pub.publish(step)
                pub.flush()
                assert sub.poll() == step
                assert sub.update() == step
                for a, b in zip(trainer.parameters(), follower.parameters()):
                    assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))
        assert pub.keep_anchors == 0  # retention found it cannot list and stopped trying
        assert "/weights/run-1/manifests/" + f"{0:020d}.json" in server.objects
    finally:
        server.stop()
