"""The compact delta layout from Python: written by the C++ library through DeltaPublisher,
read by DeltaSubscriber (decoded against host weights directly, or in two phases -- positions
and unbased values first, then the base bits gathered where the weights live), by the vLLM
worker extension, and by the C++ CLI in both directions."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import vllm_standin as vs  # noqa: E402
from test_torch_pubsub import NO_SIZE_ANCHORS, bits_equal, make_model, manifest, train_step  # noqa: E402

import deltasync  # noqa: E402
from deltasync._files import parse_delta, rebase_values  # noqa: E402
from deltasync.vllm import DeltaWorkerExtension  # noqa: E402


@pytest.fixture
def store(tmp_path):
    return f"file://{tmp_path / 'bucket'}"


def meta_of(model):
    return [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]


def stored_delta(store: str, version: int) -> bytes:
    """Version `version`'s delta as a folder store holds it, checked against its manifest."""
    ref = manifest(store, version)["delta"]
    data = (Path(store.removeprefix("file://")) / ref["key"]).read_bytes()
    assert len(data) == ref["size"] and hashlib.sha256(data).hexdigest() == ref["sha256"]
    return data


def test_compact_is_the_default_and_the_subscriber_follows_bit_identically(store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, anchor_share=NO_SIZE_ANCHORS) as pub:
        pub.publish(0)
        for step in range(1, 5):
            train_step(trainer, optimizer, step)
            assert pub.publish(step).changed_elements > 0
            pub.flush()
            assert manifest(store, step)["delta_format"] == "compact"
            assert sub.update() == step
            assert bits_equal(trainer, follower)
    assert sub.last_report.deltas == [4]


def test_compact_deltas_are_smaller_than_trl_for_the_same_steps(tmp_path):
    sizes = {}
    for fmt in ("trl", "compact"):
        # A wider model so that the file headers do not dominate.
        torch.manual_seed(0)
        trainer = torch.nn.Linear(256, 256).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
        with deltasync.DeltaPublisher(trainer, store=f"file://{tmp_path / fmt}", format=fmt) as pub:
            pub.publish(0)
            total_changed = total_bytes = 0
            for step in range(1, 4):
                g = torch.Generator().manual_seed(step)
                loss = (trainer.weight.float() * torch.randn(256, 256, generator=g)).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                stats = pub.publish(step)
                total_changed += stats.changed_elements
                pub.flush()
                total_bytes += stats.delta_bytes
        assert total_changed > 1000
        sizes[fmt] = total_bytes / total_changed
    # TRL: 4-byte index + 2-byte value per change plus header; compact: gaps and ±ulp symbols.
    assert sizes["trl"] > 6.0
    assert sizes["compact"] < sizes["trl"] / 2


def test_two_phase_read_equals_direct_decode_and_applies(store):
    trainer, follower = make_model(0), make_model(1)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, anchor_share=NO_SIZE_ANCHORS) as pub:
        pub.publish(0)
        pub.flush()
        sub = deltasync.DeltaSubscriber(follower, store=store)
        sub.update()
        train_step(trainer, optimizer, 1)
        pub.publish(1)
    data = stored_delta(store, 1)
    base = [p.detach() for p in follower.parameters()]
    direct = parse_delta(data, "d", meta_of(follower), base)
    relative = parse_delta(data, "d", meta_of(follower))
    assert not direct.relative and relative.relative and direct.format == relative.format == "compact"
    assert direct.changed.keys() == relative.changed.keys() and direct.changed
    assert direct.result_digests == relative.result_digests is not None
    tensors = dict(follower.named_parameters())
    for name, (idx, new) in direct.changed.items():
        ridx, unbased = relative.changed[name]
        assert torch.equal(idx, ridx)
        base_bits = tensors[name].detach().reshape(-1)[idx]
        rebased = rebase_values(unbased, base_bits, [idx.numel()], [new.element_size()]).view(new.dtype)
        assert torch.equal(rebased.view(torch.int16), new.view(torch.int16)), name
        assert not torch.equal(unbased.view(torch.int16), new.view(torch.int16))  # really relative
    # The subscriber applies the same delta and reaches the trainer. (On the CPU it decodes
    # against the host weights directly; the two-phase path a GPU-resident subscriber runs is
    # test_cuda_subscriber_reads_compact_in_two_phases below and tests/test_compact_two_phase.cpp.)
    assert sub.update() == 1 and sub.last_report.deltas == [1]
    assert bits_equal(trainer, follower)


def test_rebase_covers_sign_and_exponent_boundaries():
    base = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0 ** -126, 65504.0, -3.5], dtype=torch.bfloat16)
    bits = base.view(torch.int16)
    # +1 / -1 ulp in bit space (crossing +0/-0 and into NaN patterns) and a large exponent jump.
    new = torch.stack([bits + 1, bits - 1, bits ^ 0x4000, bits ^ -0x8000]).view(torch.bfloat16)
    from deltasync._files import serialize_delta
    for row in new:
        changed = (row.view(torch.int16) != bits).nonzero().reshape(-1)
        assert changed.numel() == 7
        data = serialize_delta("compact", [("w", torch.bfloat16, (7,))], changed, row[changed].view(torch.uint8),
                               base[changed].view(torch.uint8), [changed.numel()], 1, 0, [0], [0])
        rel = parse_delta(data, "d", [("w", torch.bfloat16, (7,))])
        idx, unbased = rel.changed["w"]
        out = rebase_values(unbased, base[idx], [idx.numel()], [2]).view(torch.int16)
        assert torch.equal(out, row.view(torch.int16)[changed])


def test_low_memory_mode_defaults_to_trl_and_refuses_compact(store):
    with deltasync.DeltaPublisher(make_model(0), store=store, low_memory=True) as pub:
        assert pub.format == "trl"
    with pytest.raises(ValueError, match="format 'compact' .* the low-memory shadow does not keep; use format 'trl'"):
        deltasync.DeltaPublisher(make_model(0), store=store, low_memory=True, format="compact")
    with pytest.raises(ValueError, match=r"unknown delta format 'zstd' \(choose compact, trl"):
        deltasync.DeltaPublisher(make_model(0), store=store, format="zstd")


def test_corrupt_compact_delta_is_refused_with_its_name(store):
    trainer = make_model(0)
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        with torch.no_grad():
            trainer[1].weight.view(torch.int16)[0, :40] += 1
        pub.publish(1)
    data = bytearray(stored_delta(store, 1))
    data[-3] ^= 0xFF  # inside the last tensor's payload
    with pytest.raises(RuntimeError, match="delta_read: bad.safetensors"):
        parse_delta(bytes(data), "bad.safetensors", meta_of(trainer))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_vllm_workers_apply_compact_deltas_bit_identically(tmp_path, tp_size):
    Worker = vs.make_worker_class(DeltaWorkerExtension)
    config = vs.Config(tie_word_embeddings=True)
    trainer = vs.HFModel(config, seed=0)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=2e-5)
    store = f"file://{tmp_path / 'bucket'}"
    workers = vs.make_workers(Worker, config, tp_size)  # each rank with its shard and its TP group
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=100, format="compact", anchor_share=NO_SIZE_ANCHORS) as pub:
        pub.publish(0)
        pub.flush()
        vs.on_all_ranks(workers, "deltasync_init", store)
        for step in (1, 2):
            g = torch.Generator().manual_seed(step)
            loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in trainer.parameters())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            pub.publish(step)
            pub.flush()
            state = {n: p.detach().clone() for n, p in trainer.named_parameters()}
            for r, (w, report) in enumerate(zip(workers, vs.on_all_ranks(workers, "deltasync_update"))):
                assert report["deltas"] == [step] and report["applied_elements"] > 0
                expected = vs.reference_runtime_params(config, vs.TP(r, tp_size), state)
                for name, p in w.model_runner.model.named_parameters():
                    assert torch.equal(p.detach().view(torch.int16), expected[name].view(torch.int16)), name
    assert sorted(p.name[:20] for p in (tmp_path / "bucket" / "deltas").iterdir()) == [f"{v:020d}" for v in (1, 2)]


# A vLLM worker serving another dtype than the published one is refused before anything is
# written (deltas carry published bits): test_vllm_extension.py::
# test_runtime_dtype_other_than_the_checkpoints_is_refused_before_anything_is_written.


@pytest.mark.skipif(not (torch.cuda.is_available() and deltasync.has_cuda_ops()),
                    reason="needs a CUDA device and a deltasync build with the CUDA backend")
def test_cuda_subscriber_reads_compact_in_two_phases(store):
    trainer, follower = make_model(0).cuda(), make_model(1).cuda()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    sub = deltasync.DeltaSubscriber(follower, store=store)
    with deltasync.DeltaPublisher(trainer, store=store, format="compact") as pub:
        pub.publish(0)
        for step in (1, 2, 3):
            train_step(trainer, optimizer, step)
            pub.publish(step)
            pub.flush()
            assert sub.update() == step
            assert bits_equal(trainer, follower)


# Interoperability with the C++ CLI in both layouts: test_torch_pubsub.py (parametrized by format).
