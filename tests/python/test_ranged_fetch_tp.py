"""Two tensor-parallel ranks of the vLLM receiver (the stand-in, ranks on threads over real gloo
groups) read only the byte ranges of each compact delta that meet the elements they hold: each
rank's bytes_fetched is below the whole delta's, and every rank's runtime parameters equal a
fresh TP=2 load at every version. Row-parallel weights (every rank holds half of every row) are
read band by band: with the publisher's default tiles a rank reads its own column bands only.
A delta with one tampered block is refused on every rank, with every rank's parameters bit for
bit what they were. Both compact containers: layout 1 (NAME.cindex / NAME.cdata, chunk hashes)
and the indexed layout 2 publishers write now -- whose first read of a delta this small takes all
of it (a request costs as much as 256 KiB of transfer: ranged::merge_gaps), so its byte counts
are the C++ tests' (test_ranged_fetch IndexedRanged, deltasync-ranged-plan)."""
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


def sparse_step(model, step: int, share: float = 0.1, which=lambda name: True) -> None:
    g = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not which(name):
                continue
            bits = p.view(-1).view(torch.int16)
            pick = (torch.rand(bits.numel(), generator=g) < share).nonzero().reshape(-1)
            bits[pick] += 1


def assert_fresh_tp2(workers, trainer, label):
    for rank, w in enumerate(workers):
        wanted = vs.reference_runtime_params(CONFIG, vs.TP(rank, 2), dict(trainer.named_parameters()))
        for n, p in w.model_runner.model.named_parameters():
            assert torch.equal(p.detach().view(torch.int16), wanted[n].view(torch.int16)), f"{label} rank {rank}: {n}"


def delta_metadata(store_dir: Path, version: int) -> dict:
    manifest = json.loads((store_dir / "manifests" / f"{version:020d}.json").read_text())
    raw = (store_dir / manifest["delta"]["key"]).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + header_len])["__metadata__"]


def first_payload_byte(header: dict, layout: int) -> int:
    """Data offset of a byte inside the first block of embed_tokens (the first tensor in both
    layouts' order: file order in layout 1, natural name order in layout 2)."""
    key = "model.embed_tokens.weight.cdata" if layout == 1 else "compact.payload"
    return header[key]["data_offsets"][0] + 8


# (container layout, compact_version): both containers in version 1, and the indexed layout with
# version 2's 32 rANS lanes (the publisher's compact_version option; SIMD decode on the CPU).
@pytest.mark.parametrize("layout,version", [(1, 1), (2, 1), (2, 2)])
def test_each_rank_reads_its_share_of_every_delta_and_refuses_a_tampered_block_with_the_others(tmp_path, layout, version):
    trainer = vs.HFModel(CONFIG, seed=0)
    store_dir = tmp_path / "bucket"
    store = f"file://{store_dir}"
    workers = vs.make_workers(Worker, CONFIG, 2)
    # anchor_share=0: deltas only (three of this small model's deltas would pass the default share,
    # and an anchor at version 3 would let the ranks recover past the tampered delta).
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=0, anchor_share=0, compact_block_elements=32,
                                  compact_layout=layout, compact_version=version) as pub:
        pub.publish(0)
        pub.flush()
        vs.on_all_ranks(workers, "deltasync_init", store)
        for v in (1, 2):
            sparse_step(trainer, v)
            pub.publish(v)
            pub.flush()
            assert delta_metadata(store_dir, v)["compact_version"] == str(version)
            reports = vs.on_all_ranks(workers, "deltasync_update")
            for rank, r in enumerate(reports):
                assert r["to_version"] == v and r["deltas"] == [v]
                # Row-parallel o_proj / down_proj (split on dim 1) meet every block; the rest halves.
                if layout == 1:
                    assert 0 < r["bytes_fetched"] < 0.9 * r["delta_bytes"], f"version {v} rank {rank}: {r}"
                else:
                    assert 0 < r["bytes_fetched"] <= r["delta_bytes"], f"version {v} rank {rank}: {r}"
            assert_fresh_tp2(workers, trainer, f"version {v}")
        kept = {n: t.detach().clone() for n, t in trainer.named_parameters()}
        sparse_step(trainer, 3)
        pub.publish(3)
        pub.flush()
    # One payload bit of the first changed tensor's blocks (embed_tokens: both ranks read its
    # blocks of their vocabulary halves; the first block is rank 0's, the chunk hashes -- layout 2: its
    # entry's block hash -- catch it).
    manifest = json.loads((store_dir / "manifests" / f"{3:020d}.json").read_text())
    delta = store_dir / manifest["delta"]["key"]
    raw = bytearray(delta.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    raw[8 + header_len + first_payload_byte(header, layout)] ^= 0x20
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


ROW_PARALLEL = ("o_proj", "down_proj")


def payload_and_rest(store_dir: Path, version: int) -> tuple[int, int]:
    """A version's delta object: its blocks' bytes (every NAME.cdata), and the rest every rank
    reads (the header and every NAME.cindex)."""
    manifest = json.loads((store_dir / "manifests" / f"{version:020d}.json").read_text())
    raw = (store_dir / manifest["delta"]["key"]).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    entries = {k: v for k, v in json.loads(raw[8:8 + header_len]).items() if k != "__metadata__"}
    size = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in entries.items()}
    payload = sum(n for k, n in size.items() if k.endswith(".cdata"))
    return payload, 8 + header_len + sum(n for k, n in size.items() if k.endswith(".cindex"))


def test_row_parallel_weights_in_column_bands_are_read_by_each_rank_band_by_band(tmp_path):
    """A delta of o_proj and down_proj alone (vLLM splits them on dim 1): without tiles every block
    holds both ranks' columns and each rank reads all of it; with the default tiles (column bands)
    each rank reads, beyond the header and block indexes, about half of the blocks' bytes, and
    both end where a fresh TP=2 load does. Layout 1, whose entries name the blocks' bytes per
    tensor (the indexed layout's share: deltasync-ranged-plan, ranged-fetch results)."""
    for max_tiles in (1, 8):
        trainer = vs.HFModel(CONFIG, seed=0)
        store_dir = tmp_path / f"tiles-{max_tiles}"
        store = f"file://{store_dir}"
        workers = vs.make_workers(Worker, CONFIG, 2)
        with deltasync.DeltaPublisher(trainer, store=store, anchor_every=0, compact_block_elements=32,
                                      compact_max_tiles=max_tiles, compact_layout=1) as pub:
            pub.publish(0)
            pub.flush()
            vs.on_all_ranks(workers, "deltasync_init", store)
            sparse_step(trainer, 1, share=0.3, which=lambda name: any(k in name for k in ROW_PARALLEL))
            pub.publish(1)
            pub.flush()
            reports = vs.on_all_ranks(workers, "deltasync_update")
        assert_fresh_tp2(workers, trainer, f"max_tiles {max_tiles}")
        payload, rest = payload_and_rest(store_dir, 1)
        for rank, r in enumerate(reports):
            blocks_read = r["bytes_fetched"] - rest
            if max_tiles == 1:
                assert blocks_read > 0.95 * payload, f"rank {rank}: {blocks_read} of {payload}"  # blocks meet both ranks
            else:
                assert 0.4 * payload < blocks_read < 0.6 * payload, f"rank {rank}: {blocks_read} of {payload}"
