"""DeltaPublisher -> folder store -> DeltaSubscriber, on real AdamW steps of a small bf16 model."""
from __future__ import annotations

import contextlib
import copy
import json
import threading

import pytest
import torch

import deltasync
from deltasync.subscriber import IntegrityError


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


def test_subscriber_follows_every_step_bit_identically(store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.poll() is None
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=4) as pub:
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
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=5, max_pending=16) as pub:
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
    assert (root / "LATEST").read_text() == "2\n"
    m1 = json.loads((root / "manifests" / f"{1:020d}.json").read_text())
    m2 = json.loads((root / "manifests" / f"{2:020d}.json").read_text())
    assert m1["kind"] == "anchor" and m1["latest_anchor"] == 1 and m1["delta"] is None
    assert m2["kind"] == "delta" and m2["base_version"] == 1 and m2["changed_elements"] == 3
    assert m2["delta_format"] == "trl" and m2["latest_anchor"] == 1
    assert m2["digests"]["1.weight"] != m1["digests"]["1.weight"]
    assert m2["digests"]["0.weight"] == m1["digests"]["0.weight"]
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
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100) as pub:
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
    sub.receiver.digests["1.weight"] = deltasync.ops.digest([follower[1].weight.detach()]).item() & ((1 << 64) - 1)
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
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, low_memory=True) as pub:
        pub.publish(0)
        assert sum(s.numel() * s.element_size() for s in pub._shadow) == sum(p.numel() for p in trainer.parameters())
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


def test_failed_upload_is_reported_and_the_chain_restarts_with_an_anchor(store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100) as pub:
        pub.publish(0)
        real_put = pub.store.put

        def failing_put(key, data):
            if key.startswith("deltas/") and "00000000000000000001-" in key:
                raise OSError("disk full")
            return real_put(key, data)

        pub.store.put = failing_put
        train_step(trainer, optimizer, 1)
        pub.publish(1)
        train_step(trainer, optimizer, 2)
        with pytest.raises(RuntimeError, match="disk full"):
            pub.flush()
        pub.store.put = real_put
        stats = pub.publish(2)
        pub.flush()
        assert stats.anchor and stats.delta_bytes == 0
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.update() == 2 and sub.last_report.anchor == 2
    assert bits_equal(trainer, follower)
    assert sub.catalog.find(1) is None


@contextlib.contextmanager
def stalled_uploads(pub, gate: threading.Event):
    """Every store put of `pub` waits until `gate` is set. The gate opens by itself after 30 s
    (a regression that waits for the stalled upload then fails its assertions instead of hanging)
    and on leaving the block (so that closing the publisher can flush)."""
    safety = threading.Timer(30.0, gate.set)
    safety.start()
    real_put = pub.store.put

    def gated_put(key, data):
        gate.wait()
        return real_put(key, data)

    pub.store.put = gated_put
    try:
        yield
    finally:
        safety.cancel()
        gate.set()


def test_publisher_behind_merges_queued_deltas_instead_of_waiting(store):
    """Uploads stalled (the anchor's put waits on a gate): with max_pending=2, version 1 waits in
    the queue, and publishing 2 folds it into 2 at once instead of waiting for the upload."""
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    gate = threading.Event()
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, max_pending=2) as pub, \
            stalled_uploads(pub, gate):
        pub.publish(0)  # the anchor: its upload starts and waits at the gate
        expected = {}
        for step in (1, 2, 3):
            train_step(trainer, optimizer, step)
            expected[step] = copy.deepcopy(trainer)
            pub.publish(step)
        merges_before_gate = [(s.version, s.merged_into, s.merged_versions) for s in pub.stats]
        gate.set()
        pub.flush()
    # 1 queued behind the stalled anchor; 2 took it over (1 -> merged into 2); 3 took over 2.
    assert merges_before_gate == [(0, None, 1), (1, 2, 1), (2, 3, 2), (3, None, 3)]
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.catalog.find(1) is None and sub.catalog.find(2) is None
    assert sub.update() == 3
    assert bits_equal(expected[3], follower)
    assert sub.last_report.anchor == 0 and sub.last_report.deltas == [3]


def test_merged_away_deltas_are_freed_while_uploads_stall(store, monkeypatch):
    """A merged-away version's work item waits in the upload queue until the stalled upload ends;
    its staged delta must not wait with it (merges while the store hangs would pile up deltas)."""
    import gc
    import weakref

    import deltasync.publisher as publisher_module

    trainer = make_model(0)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    merged_away = []
    real_merge = publisher_module.merge_deltas

    def recording_merge(meta, older, newer):
        merged_away.extend(weakref.ref(t) for t in older[:3])
        return real_merge(meta, older, newer)

    monkeypatch.setattr(publisher_module, "merge_deltas", recording_merge)
    gate = threading.Event()
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, max_pending=2) as pub, \
            stalled_uploads(pub, gate):
        pub.publish(0)
        for step in (1, 2, 3, 4):
            train_step(trainer, optimizer, step)
            pub.publish(step)
        gc.collect()
        alive = sum(ref() is not None for ref in merged_away)
    assert len(merged_away) == 9  # 2, 3 and 4 each merged the one before
    assert alive == 0


def test_a_failed_merge_falls_back_to_uploading_both_versions(store, monkeypatch):
    """The merge cancels the queued version's upload first; when the merge itself then fails,
    that version must be queued again and the new one uploaded after it (publish() waits)."""
    import deltasync.publisher as publisher_module

    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    gate = threading.Event()

    def failing_merge(meta, older, newer):
        gate.set()  # the stalled upload may go on: publish() is about to wait for it
        raise RuntimeError("merge failed")

    monkeypatch.setattr(publisher_module, "merge_deltas", failing_merge)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, max_pending=2) as pub, \
            stalled_uploads(pub, gate):
        pub.publish(0)
        for step in (1, 2):
            train_step(trainer, optimizer, step)
            pub.publish(step)
        pub.flush()
        assert [(s.version, s.merged_into, s.merged_versions) for s in pub.stats] == [
            (0, None, 1), (1, None, 1), (2, None, 1)]
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.catalog.find(1) is not None
    assert sub.update() == 2
    assert bits_equal(trainer, follower)
    assert sub.last_report.deltas == [1, 2]


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
    assert all(s.device.type == "cuda" for s in pub._shadow)


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
    with pytest.raises(ValueError, match="no anchor on its chain"):
        deltasync.DeltaSubscriber(make_model(1), store=store).update()


def test_folder_store_exclusive_create(tmp_path):
    from deltasync._store import FolderStore

    s = FolderStore(tmp_path / "f")
    assert s.put_if_absent("manifests/a.json", b"one")
    assert not s.put_if_absent("manifests/a.json", b"two")
    assert s.get("manifests/a.json") == b"one"
    assert s.list("manifests/") == ["manifests/a.json"]  # no temporary files left behind
    with pytest.raises(ValueError, match="invalid object key"):
        s.get("../escape")


def test_unknown_store_scheme_is_refused():
    with pytest.raises(ValueError, match="unknown store URL scheme"):
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
    with deltasync.DeltaPublisher(trainer, store=s3_store, anchor_every=3) as pub:
        for step in range(5):
            if step:
                train_step(trainer, optimizer, step)
            pub.publish(step)
            pub.flush()
            assert sub.update() == step
            assert bits_equal(trainer, follower)
    assert [s.anchor for s in pub.stats] == [True, False, False, True, False]
    keys = pub.store.list("manifests/")
    assert keys == [f"manifests/{v:020d}.json" for v in range(5)]
    assert not pub.store.put_if_absent(keys[0], b"{}")


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
    assert pub.store.get(f"manifests/{2:020d}.json").find(f'"{fmt}"'.encode()) > 0
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
    assert sub.catalog.find(2).delta_format == fmt
    assert sub.last_report.deltas == [2]
