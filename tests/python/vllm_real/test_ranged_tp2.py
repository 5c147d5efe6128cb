"""A real vLLM engine at TP=2 follows a store written by a sharded trainer (two ranks of
deltasync.ShardedDeltaPublisher, each publishing its half of every tensor as a delta part): each
rank reads only the byte ranges of the parts that meet the elements it serves (ranged GETs over
each part's header, block indexes and blocks), so each rank's bytes_fetched is well under the
whole delta's; both ranks are bit-identical to a fresh TP=2 load at every version."""
from __future__ import annotations

import sys
from pathlib import Path

import engine as eng

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "sharded"))
from test_sharded_publish import launch  # noqa: E402

VERSIONS = 2  # an anchor, then a delta (each TP=2 engine start costs tens of seconds here)


def test_tp2_engine_follows_a_sharded_publisher_reading_only_its_ranges(tmp_path):
    store = f"file://{tmp_path / 'bucket'}"
    ranks = launch(2, store, tmp_path, VERSIONS, script=HERE / "sharded_trainer.py", timeout=300)
    assert all(rc == 0 for rc, _ in ranks), "\n".join(out for _, out in ranks)
    with eng.engine(tmp_path / "v0", 2, worker_extension_cls="deltasync.vllm.DeltaWorkerExtension") as llm:
        served = [eng.runtime_params(llm)]  # a fresh TP=2 load of version 0
        reports = llm.collective_rpc("deltasync_init", args=(store, 0))
        assert all(r["to_version"] == 0 and r["anchor"] == 0 for r in reports)
        eng.assert_same_params(eng.runtime_params(llm), served[0], "version 0 (anchor)")
        for v in range(1, VERSIONS):
            reports = llm.collective_rpc("deltasync_update", args=(v,))
            for rank, r in enumerate(reports):
                print(f"version {v} rank {rank}: bytes_fetched {r['bytes_fetched']} of delta_bytes {r['delta_bytes']}")
                assert r["deltas"] == [v] and r["applied_elements"] > 0
                # Both parts' headers (metadata of every tensor, chunk hashes) are read by both
                # ranks, and row-parallel o_proj / down_proj meet every block: tiny models keep a
                # rank well above half (benchmarks/results/ranged-fetch-2026-12-02.md: 0.6B shapes).
                assert 0 < r["bytes_fetched"] < 0.9 * r["delta_bytes"], f"version {v} rank {rank}: {r}"
            served.append(eng.runtime_params(llm))
    for v in range(1, VERSIONS):
        with eng.engine(tmp_path / f"v{v}", 2) as fresh:
            eng.assert_same_params(served[v], eng.runtime_params(fresh), f"version {v}")
