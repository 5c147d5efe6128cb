"""The vLLM receiver refuses a delta whose result digest is wrong, or that was made for another
base, and an anchor that fails its verification on one rank, inside the worker at TP=1 and TP=2
(the stand-in, ranks on threads over real gloo groups): every rank raises, and every rank's
runtime parameters are bit for bit what they were. And an anchor whose writes fail part-way on
one rank: every rank raises and is torn until a later anchor is written whole on every rank."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import store_tamper  # noqa: E402
import vllm_standin as vs  # noqa: E402

import deltasync  # noqa: E402
from deltasync.errors import DeltaSyncError, IntegrityError, WrongBaseError  # noqa: E402
from deltasync.vllm import DeltaWorkerExtension  # noqa: E402

Worker = vs.make_worker_class(DeltaWorkerExtension)


def runtime_bits(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters()}


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("tamper", ["result", "base"])
def test_a_tampered_delta_is_refused_on_every_rank_with_the_weights_unchanged(tmp_path, tp_size, tamper):
    config = vs.Config()
    trainer = vs.HFModel(config, seed=0)
    store_dir = tmp_path / "bucket"
    store = f"file://{store_dir}"
    workers = vs.make_workers(Worker, config, tp_size)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=0) as pub:
        pub.publish(0)
        pub.flush()
        vs.on_all_ranks(workers, "deltasync_init", store)
        with torch.no_grad():
            # Rows on both ranks of the vocabulary split, and a replicated norm.
            trainer.model.embed_tokens.weight.view(torch.int16)[[1, config.vocab_size - 2], 3] += 1
            trainer.model.norm.weight.view(torch.int16)[5] += 1
        pub.publish(1)
    before = [runtime_bits(w) for w in workers]
    name = "model.embed_tokens.weight"
    if tamper == "result":
        store_tamper.tamper_result_digest(store_dir, 1, name)
        expected, message = IntegrityError, "result digest mismatch for tensor model.embed_tokens.weight"
    else:
        store_tamper.tamper_base_digest(store_dir, 1, name)
        expected, message = WrongBaseError, "model.embed_tokens.weight"
    with pytest.raises(expected, match=message):
        vs.on_all_ranks(workers, "deltasync_update")
    for rank, (w, bits) in enumerate(zip(workers, before)):
        for n, p in w.model_runner.model.named_parameters():
            assert torch.equal(p.detach().view(torch.int16), bits[n].view(torch.int16)), f"rank {rank}: {n}"
        assert w.deltasync_version() == 0


@pytest.mark.parametrize("tp_size", [1, 2])
def test_an_anchor_refused_on_one_rank_writes_nothing_on_any_rank(tmp_path, tp_size):
    # The last rank reads a copy of the store whose anchor has a flipped bit (its SHA-256 made
    # to agree, so the fetch succeeds and the anchor's verification fails): that rank refuses, so
    # no rank writes, in the first try and in the recovery from the same anchor. Every rank keeps
    # the weights its engine started with.
    config = vs.Config()
    trainer = vs.HFModel(config, seed=0)
    good, bad = tmp_path / "good", tmp_path / "bad"
    with deltasync.DeltaPublisher(trainer, store=f"file://{good}") as pub:
        pub.publish(0)
        pub.flush()
    shutil.copytree(good, bad)
    store_tamper.tamper_anchor_tensor(bad, 0, "model.layers.1.mlp.down_proj.weight")
    workers = vs.make_workers(Worker, config, tp_size)
    stores = [f"file://{good}"] * (tp_size - 1) + [f"file://{bad}"]
    before = [runtime_bits(w) for w in workers]
    message = "does not match" if tp_size == 1 else "refused by 1 other rank"
    with pytest.raises(DeltaSyncError, match=message):
        vs.on_ranks(workers, [lambda w=w, s=s: w.deltasync_init(s) for w, s in zip(workers, stores)])
    for rank, (w, bits) in enumerate(zip(workers, before)):
        for n, p in w.model_runner.model.named_parameters():
            assert torch.equal(p.detach().view(torch.int16), bits[n].view(torch.int16)), f"rank {rank}: {n}"
        # What the refusal kept out was a real update: the anchor differs from the start weights.
        wanted = vs.reference_runtime_params(config, vs.TP(rank, tp_size), dict(trainer.named_parameters()))
        assert any(not torch.equal(wanted[n].view(torch.int16), bits[n].view(torch.int16)) for n in wanted)


def test_a_delta_one_rank_cannot_fetch_is_refused_on_every_rank(tmp_path):
    # The last rank's copy of the store holds delta 1 with a flipped byte (its SHA-256 fails):
    # that rank refuses the step it cannot fetch (abandon), so the other rank, already applying
    # the delta, rolls it back; the recovery from anchor 0 fails on that rank again, and every
    # rank ends where it was, at version 0.
    config = vs.Config()
    trainer = vs.HFModel(config, seed=0)
    good, bad = tmp_path / "good", tmp_path / "bad"
    with deltasync.DeltaPublisher(trainer, store=f"file://{good}", anchor_every=0) as pub:
        pub.publish(0)
        pub.flush()
        with torch.no_grad():
            trainer.model.embed_tokens.weight.view(torch.int16)[[1, config.vocab_size - 2], 3] += 1
        pub.publish(1)
    shutil.copytree(good, bad)
    manifest = json.loads((bad / "manifests" / f"{1:020d}.json").read_text())
    delta = bad / manifest["delta"]["key"]
    raw = bytearray(delta.read_bytes())
    raw[-1] ^= 1
    delta.write_bytes(bytes(raw))
    workers = vs.make_workers(Worker, config, 2)
    stores = [f"file://{good}", f"file://{bad}"]
    vs.on_ranks(workers, [lambda w=w, s=s: w.deltasync_init(s, 0) for w, s in zip(workers, stores)])
    before = [runtime_bits(w) for w in workers]
    with pytest.raises(DeltaSyncError, match="refused by 1 other rank"):
        vs.on_ranks(workers, [lambda w=w: w.deltasync_update(1) for w in workers])
    for rank, (w, bits) in enumerate(zip(workers, before)):
        for n, p in w.model_runner.model.named_parameters():
            assert torch.equal(p.detach().view(torch.int16), bits[n].view(torch.int16)), f"rank {rank}: {n}"
        assert w.deltasync_version() == 0


def _error_of(call) -> str | None:
    """The one-line message of the deltasync error `call` raises (None: it returns)."""
    try:
        call()
    except DeltaSyncError as e:
        return str(e)
    return None


@pytest.mark.parametrize("point", ["first", "middle", "last"])
def test_an_anchor_whose_writes_fail_on_one_rank_tears_every_rank_until_a_later_anchor(tmp_path, point):
    # Rank 1's writes fail part-way (after its first run, half its runs, all of them: before the
    # audit) while rank 0 writes its whole share: both ranks raise -- the first try and the
    # recovery from the same anchor --, both are torn and at no version, so the next update is an
    # anchor on both; once it is written whole every rank holds the trainer's weights.
    from deltasync.vllm.worker_subscriber import WorkerSubscriber

    config = vs.Config()
    trainer = vs.HFModel(config, seed=0)
    store = f"file://{tmp_path / 'bucket'}"
    workers = vs.make_workers(vs.StandinWorker, config, 2)
    subs = [WorkerSubscriber(w.model_runner.model, group=w.group, rank=w.rank) for w in workers]
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        pub.flush()
        vs.on_threads([lambda s=s: s.connect(store) for s in subs])
        before = [runtime_bits(w) for w in workers]
        total = subs[1].mapped.map_runs
        subs[1].mapped._fail_anchor_writes_after({"first": 1, "middle": total // 2, "last": total}[point])
        raised = vs.on_threads([lambda s=s: _error_of(lambda: s.update(0)) for s in subs])
        assert "a write failed on 1 other rank(s)" in raised[0], raised
        assert "injected failure after writing" in raised[1], raised
        for rank, (w, s, bits) in enumerate(zip(workers, subs, before)):
            assert s.mapped.torn and s.version is None and s.broken, f"rank {rank}"
            assert any(not torch.equal(p.detach().view(torch.int16), bits[n].view(torch.int16))
                       for n, p in w.model_runner.model.named_parameters()), f"rank {rank} wrote nothing"

        subs[1].mapped._fail_anchor_writes_after(None)
        with torch.no_grad():
            trainer.model.norm.weight.view(torch.int16)[0] += 1
        pub.publish(1, anchor=True)
        pub.flush()
        reports = vs.on_threads([lambda s=s: s.update(1) for s in subs])
    assert [r["anchor"] for r in reports] == [1, 1]
    for rank, (w, s) in enumerate(zip(workers, subs)):
        assert s.version == 1 and not s.mapped.torn and s.broken is None
        wanted = vs.reference_runtime_params(config, vs.TP(rank, 2), dict(trainer.named_parameters()))
        for n, p in w.model_runner.model.named_parameters():
            assert torch.equal(p.detach().view(torch.int16), wanted[n].view(torch.int16)), f"rank {rank}: {n}"
