"""deltasync.vllm.DeltaWorkerExtension against the vLLM stand-in (tests/python/vllm_standin.py):
fused q/k/v and gate/up, TP shards along either dimension, padded and tied embeddings, at
tensor-parallel sizes 1, 2 and 4. After every update each rank's runtime parameters must equal,
bit for bit, what vLLM's own full reload (load_weights of all HF tensors) would give."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import vllm_standin as vs  # noqa: E402

import deltasync  # noqa: E402
from deltasync.errors import BadDeltaError  # noqa: E402
from deltasync.vllm import DeltaWorkerExtension  # noqa: E402

Worker = vs.make_worker_class(DeltaWorkerExtension)


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_rank_matches(worker, config, tp, state):
    expected = vs.reference_runtime_params(config, tp, state)
    got = dict(worker.model_runner.model.named_parameters())
    assert expected.keys() == got.keys()
    for name, want in expected.items():
        assert torch.equal(got[name].detach().view(torch.int16), want.view(torch.int16)), f"rank {tp.rank}: {name}"


def adamw_steps(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in model.parameters())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_workers_stay_bit_identical_to_a_full_reload(tmp_path, tp_size, tied):
    config = vs.Config(tie_word_embeddings=tied)
    trainer = vs.HFModel(config, seed=0)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=2e-5)  # sparse bf16 deltas, as in RL
    store = f"file://{tmp_path / 'bucket'}"
    workers = vs.make_workers(Worker, config, tp_size)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=3) as pub:
        pub.publish(0)
        pub.flush()
        for report in vs.on_all_ranks(workers, "deltasync_init", store):
            assert report["to_version"] == 0 and report["anchor"] == 0
        for r, w in enumerate(workers):
            assert_rank_matches(w, config, vs.TP(r, tp_size), hf_state(trainer))
        for step in range(1, 5):
            adamw_steps(trainer, optimizer, step)
            stats = pub.publish(step)
            pub.flush()
            for r, (w, report) in enumerate(zip(workers, vs.on_all_ranks(workers, "deltasync_update"))):
                assert report["to_version"] == step and report["deltas"] == [step]
                assert report["anchor"] is None
                # TP=1 reads the delta whole; a TP rank by ranges, which now skip what it does not
                # hold even of this small model (its chunks end at every tensor entry).
                if tp_size == 1:
                    assert report["bytes_fetched"] == stats.delta_bytes
                else:
                    assert 0 < report["bytes_fetched"] <= stats.delta_bytes
                assert report["pause_seconds"] > 0
                assert 0 < report["changed_elements"] == stats.changed_elements
                assert_rank_matches(w, config, vs.TP(r, tp_size), hf_state(trainer))


def test_index_maps_are_runs_not_elements(tmp_path):
    config = vs.Config(hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=2, head_dim=8)
    trainer = vs.HFModel(config)
    store = f"file://{tmp_path / 'bucket'}"
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
    workers = vs.make_workers(Worker, config, 2)
    report = vs.on_all_ranks(workers, "deltasync_init", store)[1]
    imap = workers[1]._deltasync.index_map  # rank 1's map
    runs = {name: sum(t.hf_start.numel() for t in ts) for name, ts in imap.targets.items()}
    # Row-sharded (output dim): this rank's rows are one contiguous block -> one run.
    assert runs["model.layers.0.self_attn.q_proj.weight"] == 1
    assert runs["model.layers.0.mlp.gate_proj.weight"] == 1
    assert runs["model.embed_tokens.weight"] == 1
    # Column-sharded (input dim): one run per row.
    assert runs["model.layers.0.self_attn.o_proj.weight"] == config.hidden_size
    assert runs["model.layers.0.mlp.down_proj.weight"] == config.hidden_size
    # Replicated norms: one run.
    assert runs["model.norm.weight"] == 1
    total_elements = sum(p.numel() for p in trainer.parameters())
    assert imap.runs() * 50 < total_elements
    assert report["index_map_bytes"] == imap.runs() * 24


def test_kv_heads_replicated_across_ranks_map_to_the_same_hf_rows(tmp_path):
    config = vs.Config(num_heads=4, num_kv_heads=1)
    trainer = vs.HFModel(config)
    store = f"file://{tmp_path / 'bucket'}"
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        with torch.no_grad():
            trainer.model.layers[0].self_attn.k_proj.weight.view(torch.int16)[3, 7] += 1
        pub.publish(1)
    workers = vs.make_workers(Worker, config, 4)
    vs.on_all_ranks(workers, "deltasync_init", store, version=0)
    vs.on_all_ranks(workers, "deltasync_update")
    for r, w in enumerate(workers):
        assert_rank_matches(w, config, vs.TP(r, 4), hf_state(trainer))


def test_update_requires_init_and_rejects_unknown_tensors(tmp_path):
    config = vs.Config()
    worker = Worker(vs.StandinForCausalLM(config))
    with pytest.raises(RuntimeError, match="deltasync_init"):
        vs.on_all_ranks([worker], "deltasync_update")


@pytest.mark.skipif(not (torch.cuda.is_available() and deltasync.has_cuda_ops()),
                    reason="needs a CUDA device and a deltasync build with the CUDA backend")
def test_cuda_workers_stay_bit_identical(tmp_path):
    config = vs.Config()
    trainer = vs.HFModel(config)
    store = f"file://{tmp_path / 'bucket'}"
    groups = vs.tp_groups(2)
    workers = [Worker(vs.StandinForCausalLM(config, vs.TP(r, 2)).cuda(), rank=r, group=groups[r]) for r in range(2)]
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        pub.flush()
        vs.on_all_ranks(workers, "deltasync_init", store)
        for step in (1, 2):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.view(-1).view(torch.int16)[step::11] += 1
            pub.publish(step)
            pub.flush()
            for r, (w, report) in enumerate(zip(workers, vs.on_all_ranks(workers, "deltasync_update"))):
                assert report["applied_elements"] > 0
                expected = vs.reference_runtime_params(config, vs.TP(r, 2), hf_state(trainer))
                for name, p in w.model_runner.model.named_parameters():
                    assert p.device.type == "cuda"
                    assert torch.equal(p.detach().cpu().view(torch.int16), expected[name].view(torch.int16)), name


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (it needs a GPU build)")
def test_real_vllm_is_importable_and_has_worker_extensions():
    import vllm  # noqa: F401
    from vllm.config import ParallelConfig

    assert "worker_extension_cls" in ParallelConfig.__dataclass_fields__


def test_tied_lm_head_published_under_both_names(tmp_path):
    # A trainer may publish a state dict that names the tied matrix twice; vLLM's loader skips
    # lm_head.weight, so its changes must land once, through the embedding.
    config = vs.Config(tie_word_embeddings=True)
    trainer = vs.HFModel(config)
    tensors = dict(trainer.named_parameters())
    tensors["lm_head.weight"] = trainer.lm_head.weight
    store = f"file://{tmp_path / 'bucket'}"
    with deltasync.DeltaPublisher(tensors, store=store) as pub:
        pub.publish(0)
        pub.flush()
        workers = vs.make_workers(Worker, config, 2)
        vs.on_all_ranks(workers, "deltasync_init", store)
        with torch.no_grad():
            trainer.model.embed_tokens.weight.view(torch.int16)[[1, 70, 99], 3] += 1
        pub.publish(1)
        pub.flush()
        imap = workers[0]._deltasync.index_map
        assert imap.targets["lm_head.weight"] == []
        reports = vs.on_all_ranks(workers, "deltasync_update")
        assert all(r["changed_elements"] == 6 for r in reports)  # the delta names both
        assert sum(r["applied_elements"] for r in reports) == 3  # written once, through the embedding
        for r, w in enumerate(workers):
            assert_rank_matches(w, config, vs.TP(r, 2), hf_state(trainer))


def test_runtime_dtype_other_than_the_checkpoints_is_refused_before_anything_is_written(tmp_path):
    # vLLM serving in float32 a model published in bfloat16: a delta's bits cannot be written as
    # they are, nor its digests checked in the runtime parameters. Refused at init, one line, with
    # the engine's weights untouched.
    config = vs.Config()
    trainer = vs.HFModel(config)
    store = f"file://{tmp_path / 'bucket'}"
    worker = Worker(vs.StandinForCausalLM(config, vs.TP(0, 1), dtype=torch.float32))
    before = hf_state(worker.model_runner.model)
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
    with pytest.raises(BadDeltaError, match=r"model\.embed_tokens\.weight is published as BF16 but served .* as F32"):
        vs.on_all_ranks([worker], "deltasync_init", store)
    for name, p in worker.model_runner.model.named_parameters():
        assert torch.equal(p.detach().view(torch.int32), before[name].view(torch.int32)), name


def test_a_digest_mismatch_on_one_rank_rolls_back_every_rank_and_recovers(tmp_path):
    # Rank 0 holds embedding row 1; a write behind the extension's back into the element the
    # next delta changes makes rank 0's result partial wrong. The combined result digest then
    # fails on every rank, every rank rolls back and both recover from the anchor.
    config = vs.Config()
    trainer = vs.HFModel(config)
    store = f"file://{tmp_path / 'bucket'}"
    workers = vs.make_workers(Worker, config, 2)
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        pub.flush()
        vs.on_all_ranks(workers, "deltasync_init", store)
        with torch.no_grad():
            trainer.model.embed_tokens.weight.view(torch.int16)[1, 3] += 1
            workers[0].model_runner.model.model.embed_tokens.weight.view(torch.int16)[1, 3] += 7
        pub.publish(1)
        pub.flush()
        reports = vs.on_all_ranks(workers, "deltasync_update")
    for r, (w, report) in enumerate(zip(workers, reports)):
        assert report["to_version"] == 1
        assert report["recovered"] and "digest" in report["recovered"], report["recovered"]
        assert report["anchor"] == 0
        assert_rank_matches(w, config, vs.TP(r, 2), hf_state(trainer))


@pytest.mark.parametrize("point", ["first", "middle", "last"])
def test_anchor_failing_part_way_leaves_the_worker_torn_until_an_anchor_is_written_whole(tmp_path, point):
    from deltasync.vllm.worker_subscriber import WorkerSubscriber

    config = vs.Config()
    trainer = vs.HFModel(config, seed=0)
    store = f"file://{tmp_path / 'bucket'}"
    model = vs.StandinForCausalLM(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        pub.flush()
        sub = WorkerSubscriber(model)
        sub.connect(store)
        total = sub.mapped.map_runs
        sub.mapped._fail_anchor_writes_after({"first": 1, "middle": total // 2, "last": total}[point])
        with pytest.raises(deltasync.errors.DeltaSyncError, match="injected failure after writing"):
            sub.update(0)
        assert sub.mapped.torn and sub.version is None
        assert "injected failure after writing" in sub.broken and "\n" not in sub.broken
        changed = [n for n, p in model.named_parameters() if not torch.equal(p.view(torch.int16), before[n].view(torch.int16))]
        assert changed, "nothing was written before the failure"
        if point != "last":
            assert len(changed) < len(before)
        sub.mapped._fail_anchor_writes_after(None)
        with torch.no_grad():
            trainer.model.norm.weight.view(torch.int16)[0] += 1
        pub.publish(1, anchor=True)
        pub.flush()
        report = sub.update(1)
    assert report["to_version"] == 1 and report["anchor"] == 1
    assert sub.broken is None and not sub.mapped.torn and sub.version == 1
    assert_rank_matches(vs.StandinWorker(model), config, vs.TP(), hf_state(trainer))


def test_anchor_failing_before_its_first_write_leaves_the_weights_as_they_were(tmp_path):
    from deltasync.vllm.worker_subscriber import WorkerSubscriber

    config = vs.Config()
    store = f"file://{tmp_path / 'bucket'}"
    with deltasync.DeltaPublisher(vs.HFModel(config), store=store) as pub:
        pub.publish(0)
    model = vs.StandinForCausalLM(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sub = WorkerSubscriber(model)
    sub.connect(store)
    sub.mapped._fail_anchor_writes_after(0)  # fails at the first write, before it: nothing changes
    with pytest.raises(deltasync.errors.DeltaSyncError, match="injected failure after writing 0 of"):
        sub.update(0)
    assert not sub.mapped.torn and sub.broken is None
    for n, p in model.named_parameters():
        assert torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n
