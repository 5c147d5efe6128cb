"""DeltaPublisher -> folder store -> DeltaSubscriber, on real AdamW steps of a small bf16 model."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

import deltasync
from deltasync.errors import DeltaSyncError, StoreUnavailableError
from deltasync.subscriber import IntegrityError

sys.path.insert(0, os.path.dirname(__file__))
from fault_proxy import FaultProxy  # noqa: E402
from test_http_store import DavServer  # noqa: E402

# Far above any delta of these small models: anchors come from anchor_every (or are forced)
# only, so tests about the chain's cadence do not depend on delta sizes.
NO_SIZE_ANCHORS = 1e9


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 64))
    return model.to(torch.bfloat16)


def bits_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        if not torch.equal(pa.detach().view(torch.int16), pb.detach().view(torch.int16)):
            return False
    return True


def train_step(model, optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # Drawn on the CPU (same tokens on every device), then moved to the model's device.
    tokens = torch.randint(0, 64, (8, 5), generator=g).to(next(model.parameters()).device)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), tokens.roll(1, dims=1).reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.fixture
def store(tmp_path):
    return f"file://{tmp_path / 'bucket'}"


def manifest(store: str, version: int) -> dict:
    """A folder store's manifest of `version`, as the publisher wrote it."""
    return json.loads((Path(store.removeprefix("file://")) / "manifests" / f"{version:020d}.json").read_text())


@pytest.fixture
def http_store(monkeypatch):
    """The WebDAV-like store of test_http_store.py behind a fault proxy, so that a test can stall
    (proxy.add("gate", ...)) or fail (proxy.add("status", ...)) the PUTs of chosen keys. `objects`
    is what the server holds (path -> bytes)."""
    monkeypatch.setenv("DELTASYNC_STORE_RETRY_BASE_MS", "1")  # injected 5xx: retried without waiting long
    dav = DavServer()
    proxy = FaultProxy(*dav.httpd.server_address).start()
    yield types.SimpleNamespace(url=f"{proxy.url}/weights/run-1", proxy=proxy, objects=dav.objects)
    proxy.stop()
    dav.stop()


def test_subscriber_follows_every_step_bit_identically(store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.poll() is None
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=4, anchor_share=NO_SIZE_ANCHORS) as pub:
        pub.publish(0)
        pub.flush()
        assert sub.update() == 0 and sub.last_report.anchor == 0
        assert bits_equal(trainer, follower)
        for step in range(1, 7):
            train_step(trainer, optimizer, step)
            stats = pub.publish(step)
            pub.flush()
            assert sub.poll() == step
            assert sub.update() == step
            assert bits_equal(trainer, follower)
            assert 0 < stats.changed_elements < stats.total_elements
            assert sub.last_report.deltas == [step] and sub.last_report.anchor is None
            assert sub.last_report.bytes_fetched == stats.delta_bytes
    anchors = [s.version for s in pub.stats if s.anchor]
    assert anchors == [0, 4]


def test_late_subscriber_plans_from_anchor_and_chains_deltas(store, tmp_path):
    trainer = make_model(0)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    snapshots = {}
    # max_pending above the number of versions: every version is uploaded on its own (a publisher
    # further behind merges queued versions, see test_publisher_behind_merges_...).
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=5, max_pending=16,
                                  anchor_share=NO_SIZE_ANCHORS) as pub:
        for step in range(0, 8):
            for group in optimizer.param_groups:  # small steps (sparse deltas) first, then large ones
                group["lr"] = 1e-5 if step < 6 else 1e-3
            if step:
                train_step(trainer, optimizer, step)
            pub.publish(step)
            snapshots[step] = copy.deepcopy(trainer)
    follower = make_model(2)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.update(3) == 3
    assert sub.last_report.anchor == 0 and sub.last_report.deltas == [1, 2, 3]
    assert bits_equal(follower, snapshots[3])
    assert sub.update() == 7
    sizes = {s.version: s for s in pub.stats}
    via_deltas = sum(sizes[v].delta_bytes for v in (4, 5, 6, 7))
    via_anchor = sizes[5].anchor_bytes + sizes[6].delta_bytes + sizes[7].delta_bytes
    if via_deltas <= via_anchor:
        assert sub.last_report.deltas == [4, 5, 6, 7] and sub.last_report.anchor is None
    else:
        assert sub.last_report.deltas == [6, 7] and sub.last_report.anchor == 5
    assert sub.last_report.bytes_fetched == min(via_deltas, via_anchor)
    assert bits_equal(follower, snapshots[7])
    fresh = make_model(3)
    sub2 = deltasync.DeltaSubscriber(fresh, store=store)
    sub2.update()
    assert sub2.last_report.anchor == 5 and sub2.last_report.deltas == [6, 7]
    assert bits_equal(fresh, snapshots[7])


def test_store_layout_is_the_protocols(store, tmp_path):
    trainer = make_model(0)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=10, format="trl") as pub:
        pub.publish(1)
        with torch.no_grad():
            trainer[1].weight.view(torch.int16)[0, :3] += 1
        pub.publish(2)
    root = tmp_path / "bucket"
    assert (root / "LATEST").read_text() == "2\nrun unnamed\nepoch 1\nsince none\n"  # the version, then the fence
    m1 = json.loads((root / "manifests" / f"{1:020d}.json").read_text())
    m2 = json.loads((root / "manifests" / f"{2:020d}.json").read_text())
    assert m1["kind"] == "anchor" and m1["latest_anchor"] == 1 and m1["delta"] is None
    assert m2["kind"] == "delta" and m2["base_version"] == 1 and m2["changed_elements"] == 3
    assert m2["delta_format"] == "trl" and m2["latest_anchor"] == 1
    assert m2["digests"]["1.weight"] != m1["digests"]["1.weight"]
    assert m2["digests"]["0.weight"] == m1["digests"]["0.weight"]
    assert m1["fence"] == m2["fence"] == {"run": "unnamed", "epoch": 1, "since": None}
    from safetensors import safe_open

    with safe_open(root / m2["delta"]["key"], "pt") as f:
        assert sorted(f.keys()) == ["1.weight.indices", "1.weight.values"]
        assert f.get_tensor("1.weight.indices").tolist() == [0, 1, 2]
        assert f.get_tensor("1.weight.indices").dtype == torch.int32
        meta = f.metadata()
    assert meta["sparse"] == "True" and meta["model_version"] == "2" and meta["base_version"] == "1"
    assert json.loads(meta["changed_params"]) == ["1.weight"]
    assert set(json.loads(meta["base_digests"])) == {"1.weight"}


def test_tampered_weights_are_found_by_audit_and_rebuilt_from_anchor(store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, anchor_share=NO_SIZE_ANCHORS) as pub:
        pub.publish(0)
        pub.flush()
        sub.update()
        with torch.no_grad():  # someone writes into the follower's weights behind our back
            follower[3].weight.view(torch.int16)[5, 5] ^= 1
        train_step(trainer, optimizer, 1)
        pub.publish(1)
    assert sub.update(audit=True) == 1
    assert sub.last_report.recovered and "3.weight" in sub.last_report.recovered
    assert sub.last_report.anchor == 0 and sub.last_report.deltas == [1]
    assert bits_equal(trainer, follower)


def test_corrupted_object_is_refused(store, tmp_path):
    trainer, follower = make_model(0), make_model(1)
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
    part = next((tmp_path / "bucket" / "anchors").rglob("*.safetensors"))
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    before = [p.detach().clone() for p in follower.parameters()]
    with pytest.raises(ValueError, match="sha256"):
        deltasync.DeltaSubscriber(follower, store=store).update()
    assert all(torch.equal(a, b) for a, b in zip(before, follower.parameters()))


def test_wrong_base_delta_is_refused_and_nothing_written(store):
    trainer = make_model(0)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=0) as pub:
        pub.publish(0)
        with torch.no_grad():
            trainer[1].weight.view(torch.int16)[0, 0] += 1
        pub.publish(1)
    follower = make_model(0)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    sub.update(0)
    with torch.no_grad():
        follower[1].weight.view(torch.int16)[0, 0] += 7  # now not version 0 any more
    snapshot = follower[1].weight.detach().clone()
    sub.recompute_digests()  # the subscriber now knows its weights are no longer version 0's
    # The only anchor is version 0; recovery reloads it and re-applies delta 1.
    assert sub.update() == 1
    assert sub.last_report.recovered
    assert bits_equal(trainer, follower)
    assert not torch.equal(snapshot, follower[1].weight.detach())


def test_optimizer_hook_publishes_every_step(store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        pub.attach(optimizer)
        for step in range(1, 4):
            train_step(trainer, optimizer, step)
    assert [s.version for s in pub.stats] == [0, 1, 2, 3]
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.update() == 3 and bits_equal(trainer, follower)


def test_low_memory_mode_follows_training_and_catches_missed_changes(store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, low_memory=True, anchor_share=NO_SIZE_ANCHORS) as pub:
        pub.publish(0)
        assert pub.shadow_bytes == sum(p.numel() for p in trainer.parameters())  # one byte per bf16 element
        for step in (1, 2):
            train_step(trainer, optimizer, step)
            pub.publish(step)
            pub.flush()
            sub.update()
            assert bits_equal(trainer, follower)
        # A sign flip changes only the high byte: the low-byte shadow cannot see it.
        # (a) In a tensor with no other change: the publisher's full digests notice and this
        # version becomes an anchor without a delta.
        with torch.no_grad():
            trainer[1].weight.view(torch.int16)[2, 2] ^= -32768
        stats = pub.publish(3)
        pub.flush()
        assert stats.anchor and stats.delta_bytes == 0
        assert sub.update() == 3 and sub.last_report.anchor == 3
        assert bits_equal(trainer, follower)
        # (b) In a tensor that also has seen changes: the delta's result digests disagree with
        # what the subscriber computes; it refuses and leaves its weights as they were.
        train_step(trainer, optimizer, 4)
        with torch.no_grad():
            trainer[1].weight.view(torch.int16)[3, 3] ^= -32768
        pub.publish(4)
        pub.flush()
        before = [p.detach().clone() for p in follower.parameters()]
        with pytest.raises(IntegrityError, match="result digest mismatch for tensor 1.weight"):
            sub.update()
        assert all(torch.equal(a, b) for a, b in zip(before, follower.parameters()))
        train_step(trainer, optimizer, 5)
        pub.publish(5, anchor=True)  # the next anchor heals it
    assert sub.update() == 5 and sub.last_report.anchor == 5
    assert bits_equal(trainer, follower)


def test_failed_upload_is_reported_then_retried_and_the_chain_goes_on(http_store):
    """The store refuses version 1's delta (507, as a WebDAV server that is full): flush() reports
    it naming the object; the version stays queued and is uploaded again with the next publish,
    so the chain goes on with deltas (no anchor needed) once the store takes writes again."""
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    sub = deltasync.DeltaSubscriber(follower, store=http_store.url)
    with deltasync.DeltaPublisher(trainer, store=http_store.url, anchor_every=100, anchor_share=NO_SIZE_ANCHORS) as pub:
        pub.publish(0)
        pub.flush()
        assert sub.update() == 0
        http_store.proxy.add("status", times=10**6, method="PUT", path_contains=f"/deltas/{1:020d}-",
                             status=507, code="InsufficientStorage")
        train_step(trainer, optimizer, 1)
        with pytest.raises(StoreUnavailableError, match=rf"/deltas/{1:020d}-[0-9a-f]+\.safetensors: PUT failed .*HTTP 507"):
            pub.publish(1)  # staged either way; reports the failure if the upload failed already
            pub.flush()
        assert [(s.version, s.visible) for s in pub.stats] == [(0, True), (1, False)]
        assert pub.state()["last_version"] == 0
        assert not sub.has_version(1) and sub.poll() == 0
        http_store.proxy.clear()  # the store takes writes again
        after_1 = copy.deepcopy(trainer)
        train_step(trainer, optimizer, 2)
        pub.publish(2)  # the failure was reported by flush(): not raised again
        pub.flush()
    assert [(s.version, s.visible, s.anchor, s.base_version) for s in pub.stats] == [
        (0, True, True, None), (1, True, False, 0), (2, True, False, 1)]
    assert sub.update(1) == 1 and sub.last_report.deltas == [1]
    assert bits_equal(after_1, follower)
    assert sub.update() == 2 and sub.last_report.deltas == [2] and sub.last_report.anchor is None
    assert bits_equal(trainer, follower)


@contextlib.contextmanager
def stalled_puts(http_store):
    """Every PUT to `http_store` waits at the proxy until the yielded gate is set (the gate opens
    by itself on leaving the block, so that closing the publisher can flush, and the proxy lets
    a request go after 30 s: a regression that waits for a stalled upload then fails its
    assertions instead of hanging). Yields (gate, fault): fault.hit is set once a PUT waits."""
    gate = threading.Event()
    fault = http_store.proxy.add("gate", times=10**9, method="PUT", event=gate)
    try:
        yield gate, fault
    finally:
        gate.set()


def test_publisher_behind_merges_queued_deltas_instead_of_waiting(http_store):
    """Uploads stalled (the anchor's PUT waits at the proxy): with max_pending=1, version 1 waits
    in the queue, and publishing 2 folds it into 2 at once instead of waiting for the upload."""
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    with deltasync.DeltaPublisher(trainer, store=http_store.url, anchor_every=100, anchor_share=NO_SIZE_ANCHORS,
                                  max_pending=1) as pub, stalled_puts(http_store) as (gate, stalled):
        pub.publish(0)
        assert stalled.hit.wait(30)  # the anchor's upload has started and waits at the gate
        expected = {}
        for step in (1, 2, 3):
            train_step(trainer, optimizer, step)
            expected[step] = copy.deepcopy(trainer)
            pub.publish(step)
        merges_before_gate = [(s.version, s.merged_into, s.merged_versions, s.visible) for s in pub.stats]
        gate.set()
        pub.flush()
    # 1 queued behind the stalled anchor; 2 took it over (1 -> merged into 2); 3 took over 2.
    assert merges_before_gate == [(0, None, 1, False), (1, 2, 1, False), (2, 3, 2, False), (3, None, 3, False)]
    assert [(s.version, s.visible, s.base_version) for s in pub.stats if s.merged_into is None] == [(0, True, None), (3, True, 0)]
    sub = deltasync.DeltaSubscriber(follower, store=http_store.url)
    assert not sub.has_version(1) and not sub.has_version(2)
    assert sub.update() == 3
    assert bits_equal(expected[3], follower)
    assert sub.last_report.anchor == 0 and sub.last_report.deltas == [3]
    deltas = [k for k in http_store.objects if "/deltas/" in k]
    assert len(deltas) == 1 and f"/deltas/{3:020d}-" in deltas[0]  # nothing uploaded for 1 and 2


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_merged_away_deltas_are_freed_while_uploads_stall(http_store):
    """While the store hangs, every publish folds into the one pending delta; what was merged
    away must be freed at once, so memory stays at about one staged delta however many versions
    pile up (not one per version)."""
    torch.manual_seed(0)
    trainer = torch.nn.Linear(1024, 2048, bias=False).to(torch.bfloat16)
    weight = trainer.weight.detach()
    # Every element changes each step: a staged delta holds an int64 position and the new and
    # base bits per element, 12 bytes.
    staged_bytes = weight.numel() * 12
    steps = 12
    with deltasync.DeltaPublisher(trainer, store=http_store.url, anchor_every=100, anchor_share=NO_SIZE_ANCHORS,
                                  max_pending=1) as pub, stalled_puts(http_store) as (gate, stalled):
        pub.publish(0)
        assert stalled.hit.wait(30)
        with torch.no_grad():
            weight.view(torch.int16).add_(1)
        pub.publish(1)  # queued: the one pending delta
        before = resident_bytes()
        for step in range(2, steps + 1):
            with torch.no_grad():
                weight.view(torch.int16).add_(1)
            pub.publish(step)
        grown = resident_bytes() - before
        assert pub.last_report.merged_versions == steps and not pub.last_report.visible
        gate.set()
    # Kept deltas would take (steps - 1) * staged_bytes more; freed ones about none (a merge
    # briefly holds the two inputs and its output).
    assert grown < 3 * staged_bytes, f"resident set grew by {grown} bytes over {steps - 1} merges"
    follower = torch.nn.Linear(1024, 2048, bias=False).to(torch.bfloat16)
    sub = deltasync.DeltaSubscriber(follower, store=http_store.url)
    assert sub.update() == steps and sub.last_report.deltas == [steps]
    assert torch.equal(follower.weight.detach().view(torch.int16), weight.view(torch.int16))


def test_deltas_that_cannot_merge_make_publish_wait_and_both_versions_are_uploaded(http_store):
    """Low-memory deltas carry no base bits, so two of them cannot be folded into one: with the
    queue full, publish() waits for the stalled upload instead of merging (or dropping) the
    queued version, and both versions reach the store as deltas of the chain."""
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    with deltasync.DeltaPublisher(trainer, store=http_store.url, anchor_every=100, anchor_share=NO_SIZE_ANCHORS,
                                  max_pending=1, low_memory=True) as pub, stalled_puts(http_store) as (gate, stalled):
        pub.publish(0)
        assert stalled.hit.wait(30)
        train_step(trainer, optimizer, 1)
        pub.publish(1)  # queued behind the stalled anchor
        train_step(trainer, optimizer, 2)
        # The gate opens from another thread while publish(2) waits; publish(2) cannot return
        # before (version 1 can only leave the queue once the anchor's upload went through).
        opener = threading.Timer(1.0, gate.set)
        opener.start()
        pub.publish(2)
        returned_after_gate = gate.is_set()
        opener.join()
        pub.flush()
    assert returned_after_gate
    assert [(s.version, s.merged_into, s.merged_versions, s.visible, s.base_version) for s in pub.stats] == [
        (0, None, 1, True, None), (1, None, 1, True, 0), (2, None, 1, True, 1)]
    sub = deltasync.DeltaSubscriber(follower, store=http_store.url)
    assert sub.has_version(1)
    assert sub.update() == 2
    assert bits_equal(trainer, follower)
    assert sub.last_report.anchor == 0 and sub.last_report.deltas == [1, 2]

@pytest.mark.skipif(not (torch.cuda.is_available() and deltasync.has_cuda_ops()),
                    reason="needs a CUDA device and a deltasync build with the CUDA backend")
@pytest.mark.parametrize("low_memory", [False, True], ids=["shadow", "low-memory"])
def test_cuda_trainer_and_follower_stay_bit_identical(store, low_memory):
    trainer, follower = make_model(0).cuda(), make_model(1).cuda()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=3, low_memory=low_memory) as pub:
        assert pub.device.type == "cuda"
        for step in range(5):
            if step:
                g = torch.Generator().manual_seed(step)
                tokens = torch.randint(0, 64, (8, 5), generator=g).cuda()
                loss = trainer(tokens).float().square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            pub.publish(step)
            pub.flush()
            assert sub.update() == step
            assert bits_equal(trainer, follower)
        # The shadow lives with the weights: full bits or their low byte, and every version's
        # change set crossed from the device to the host (0 on the CPU engine).
        assert pub.shadow_bytes == sum(p.numel() for p in trainer.parameters()) * (1 if low_memory else 2)
        assert all(s.device_to_host_bytes > 0 for s in pub.stats)


def test_store_for_another_model_is_refused_without_writing(store):
    trainer = make_model(0)
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
    other = torch.nn.Linear(4, 4).to(torch.bfloat16)
    before = other.weight.detach().clone()
    with pytest.raises(ValueError, match="not in this model"):
        deltasync.DeltaSubscriber(other, store=store).update()
    assert torch.equal(before, other.weight.detach())


def test_no_anchor_left_on_the_chain_is_an_error(store, tmp_path):
    import shutil

    trainer = make_model(0)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=0) as pub:
        pub.publish(0)
        with torch.no_grad():
            trainer[1].weight.view(torch.int16)[0, 0] += 1
        pub.publish(1)
    (tmp_path / "bucket" / "manifests" / f"{0:020d}.json").unlink()  # retention removed version 0
    shutil.rmtree(tmp_path / "bucket" / "anchors")
    with pytest.raises(deltasync.errors.NotFoundError, match=r"bucket: no way to reach version 1 \(no anchor left on its chain\)"):
        deltasync.DeltaSubscriber(make_model(1), store=store).update()


def test_a_version_is_created_once_and_nothing_is_left_half_written(store, tmp_path):
    """The manifest is created exclusively: a second publisher (another model, no shared state)
    publishing the same version is refused naming the manifest, and the store keeps the first
    version's manifest and objects only (no temporary files left behind)."""
    trainer = make_model(0)
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
    root = tmp_path / "bucket"
    files_before = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    first = manifest(store, 0)
    other = deltasync.DeltaPublisher(make_model(7), store=store)
    refused = rf"manifests/{0:020d}\.json: version 0 already exists"
    with pytest.raises(DeltaSyncError, match=refused):  # by publish() when the upload failed already, else flush()
        other.publish(0)
        other.flush()
    with pytest.raises(DeltaSyncError, match=refused):  # tried again on close, refused again
        other.close()
    assert manifest(store, 0) == first
    assert sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()) == files_before
    referenced = {first["delta"]["key"]} if first["delta"] else set()
    referenced |= {part["key"] for part in first["anchor_parts"]}
    assert {str(p) for p in files_before} == referenced | {"LATEST", f"manifests/{0:020d}.json"}


def test_unknown_store_scheme_is_refused():
    with pytest.raises(ValueError, match="ftp://host/path: unknown store URL"):
        deltasync.DeltaSubscriber(make_model(0), store="ftp://host/path")


@pytest.fixture
def s3_store(monkeypatch):
    """A moto S3 server on 127.0.0.1 (signatures checked) with one bucket; credentials through
    the environment, as the C++ S3 store reads them."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    from moto_s3 import start_signed_moto

    moto = start_signed_moto("torch-test")
    for key, value in moto.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    yield "s3://torch-test/run1"
    moto.stop()


def test_publisher_and_subscriber_over_s3(s3_store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    sub = deltasync.DeltaSubscriber(follower, store=s3_store)
    assert sub.poll() is None
    with deltasync.DeltaPublisher(trainer, store=s3_store, anchor_every=3, anchor_share=NO_SIZE_ANCHORS) as pub:
        for step in range(5):
            if step:
                train_step(trainer, optimizer, step)
            pub.publish(step)
            pub.flush()
            assert sub.update() == step
            assert bits_equal(trainer, follower)
    assert [s.anchor for s in pub.stats] == [True, False, False, True, False]
    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    listed = s3.list_objects_v2(Bucket="torch-test", Prefix="run1/manifests/")
    assert [o["Key"] for o in listed["Contents"]] == [f"run1/manifests/{v:020d}.json" for v in range(5)]
    # The manifest's create is exclusive on S3 too (conditional PUT): another publisher of
    # version 4 is refused and the manifest stays the first one's.
    first = s3.get_object(Bucket="torch-test", Key=f"run1/manifests/{4:020d}.json")["Body"].read()
    other = deltasync.DeltaPublisher(make_model(7), store=s3_store)
    with pytest.raises(DeltaSyncError, match="version 4 already exists"):  # by publish() or flush()
        other.publish(4)
        other.flush()
    with pytest.raises(DeltaSyncError, match="version 4 already exists"):
        other.close()
    assert s3.get_object(Bucket="torch-test", Key=f"run1/manifests/{4:020d}.json")["Body"].read() == first


# --- interoperability with the C++ CLI (same store protocol and delta layout) -----------------


@pytest.mark.parametrize("fmt", ["trl", "compact"])
def test_cli_pull_reads_what_the_python_publisher_wrote(store, tmp_path, run_cli, fmt):
    from safetensors.torch import load_file

    trainer = make_model(0)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, format=fmt) as pub:
        pub.publish(0)
        for step in (1, 2):
            train_step(trainer, optimizer, step)
            pub.publish(step)
    assert manifest(store, 2)["delta_format"] == fmt
    out = tmp_path / "pulled.safetensors"
    run_cli("pull", "--store", store, "-o", out, "--quiet")
    pulled = load_file(out)
    for name, p in trainer.named_parameters():
        assert torch.equal(pulled[name].view(torch.int16), p.detach().view(torch.int16)), name


@pytest.mark.parametrize("fmt", ["trl", "compact"])
def test_python_subscriber_reads_what_the_cli_published(store, tmp_path, run_cli, fmt):
    from safetensors.torch import save_file

    trainer = make_model(0)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    follower = make_model(1)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    state = tmp_path / "state"
    for step in range(3):
        if step:
            train_step(trainer, optimizer, step)
        ckpt = tmp_path / f"ckpt{step}.safetensors"
        save_file({n: p.detach().contiguous() for n, p in trainer.named_parameters()}, ckpt)
        run_cli("publish", ckpt, "--store", store, "--version", step, "--state", state, "--format", fmt, "--quiet")
        assert sub.update() == step
        assert bits_equal(trainer, follower)
    assert manifest(store, 2)["delta_format"] == fmt
    assert sub.last_report.deltas == [2]


def test_an_anchor_still_uploading_keeps_its_own_bits_when_training_moves_on(http_store):
    """Anchors stream from the publisher's shadow. When the next publish comes while the anchor's
    PUT still waits, the shadow is copied out first: the anchor must hold version 0's bits, not
    version 1's, although its upload finishes after version 1 was encoded."""
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    lines = []
    # One tensor per part, one part at a time: when the first part's PUT waits, the other parts
    # have not been read from the shadow yet.
    with deltasync.DeltaPublisher(trainer, store=http_store.url, anchor_every=100, anchor_share=NO_SIZE_ANCHORS,
                                  anchor_part_bytes=1, parallel_uploads=1, log=lines.append) as pub, \
            stalled_puts(http_store) as (gate, stalled):
        pub.publish(0)
        assert stalled.hit.wait(30)  # the anchor's first part waits; the rest is still in the shadow
        version0 = copy.deepcopy(trainer)
        train_step(trainer, optimizer, 1)
        pub.publish(1)
        assert any("still uploading" in line for line in lines), lines
        gate.set()
        pub.flush()
    sub = deltasync.DeltaSubscriber(follower, store=http_store.url)
    assert sub.update(0) == 0 and sub.last_report.anchor == 0
    assert bits_equal(version0, follower)
    assert sub.update() == 1 and sub.last_report.deltas == [1]
    assert bits_equal(trainer, follower)
