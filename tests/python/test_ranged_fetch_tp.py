"""Two tensor-parallel ranks of the vLLM receiver (the stand-in, ranks on threads over real gloo
groups) read only the byte ranges of each compact delta that meet the elements they hold: each
rank's bytes_fetched is below the whole delta's, and every rank's runtime parameters equal a
fresh TP=2 load at every version. A delta with one tampered block is refused on every rank, with
every rank's parameters bit for bit what they were."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import vllm_standin as vs  # noqa: E402

import deltasync  # noqa: E402
from deltasync.errors import DeltaSyncError  # noqa: E402
from deltasync.vllm import DeltaWorkerExtension  # noqa: E402

Worker = vs.make_worker_class(DeltaWorkerExtension)
# Large enough that a delta's data outweighs its header (metadata of every tensor, chunk hashes).
CONFIG = vs.Config(vocab_size=1000, hidden_size=64, num_heads=8, intermediate_size=128)


def runtime_bits(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters()}


def sparse_step(model, step: int, share: float = 0.1) -> None:
    g = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for p in model.parameters():
            bits = p.view(-1).view(torch.int16)
            pick = (torch.rand(bits.numel(), generator=g) < share).nonzero().reshape(-1)
            bits[pick] += 1


def assert_fresh_tp2(workers, trainer, label):
    for rank, w in enumerate(workers):
        wanted = vs.reference_runtime_params(CONFIG, vs.TP(rank, 2), dict(trainer.named_parameters()))
        for n, p in w.model_runner.model.named_parameters():
            assert torch.equal(p.detach().view(torch.int16), wanted[n].view(torch.int16)), f"{label} rank {rank}: {n}"


def test_each_rank_reads_its_share_of_every_delta_and_refuses_a_tampered_block_with_the_others(tmp_path):
    trainer = vs.HFModel(CONFIG, seed=0)
    store_dir = tmp_path / "bucket"
    store = f"file://{store_dir}"
    workers = vs.make_workers(Worker, CONFIG, 2)
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=0, compact_block_elements=32) as pub:
        pub.publish(0)
        pub.flush()
        vs.on_all_ranks(workers, "deltasync_init", store)
        for v in (1, 2):
            sparse_step(trainer, v)
            pub.publish(v)
            pub.flush()
            reports = vs.on_all_ranks(workers, "deltasync_update")
            for rank, r in enumerate(reports):
                assert r["to_version"] == v and r["deltas"] == [v]
                # Row-parallel o_proj / down_proj (split on dim 1) meet every block; the rest halves.
                assert 0 < r["bytes_fetched"] < 0.9 * r["delta_bytes"], f"version {v} rank {rank}: {r}"
            assert_fresh_tp2(workers, trainer, f"version {v}")
        kept = {n: t.detach().clone() for n, t in trainer.named_parameters()}
        sparse_step(trainer, 3)
        pub.publish(3)
        pub.flush()
    # One payload bit of the first changed tensor's blocks (embed_tokens: both ranks read its
    # blocks of their vocabulary halves; the first block is rank 0's, the chunk hashes catch it).
    manifest = json.loads((store_dir / "manifests" / f"{3:020d}.json").read_text())
    delta = store_dir / manifest["delta"]["key"]
    raw = bytearray(delta.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    begin, end = header["model.embed_tokens.weight.cdata"]["data_offsets"]
    raw[8 + header_len + begin + 8] ^= 0x20
    delta.write_bytes(bytes(raw))
    before = [runtime_bits(w) for w in workers]
    with pytest.raises(DeltaSyncError, match="sha256 differs|refused by 1 other rank"):
        vs.on_all_ranks(workers, "deltasync_update")
    for rank, (w, bits) in enumerate(zip(workers, before)):
        assert w.deltasync_version() == 2
        for n, p in w.model_runner.model.named_parameters():
            assert torch.equal(p.detach().view(torch.int16), bits[n].view(torch.int16)), f"rank {rank}: {n}"
    trainer.load_state_dict(kept)
    assert_fresh_tp2(workers, trainer, "after the refusal")
