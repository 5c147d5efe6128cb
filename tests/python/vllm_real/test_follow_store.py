"""A real vLLM engine following a deltasync store stays bit-identical to fresh vLLM loads.

For each tiny model (dense Qwen3; Qwen3 with tied, padded embeddings; Qwen2 with q/k/v biases
and one KV head replicated on both ranks at TP=2, through the backend and the worker extension;
Qwen3-MoE with fused experts) a trainer
publishes an anchor and sparse bf16 deltas, and saves each version as an HF checkpoint. The
follower engine starts from another checkpoint, then follows the store version by version.
The oracle for every version is a fresh vLLM engine loaded from that version's checkpoint:
every runtime parameter of every rank bit-identical, and the same greedy tokens and logprobs
with prefix caching on (the follower served the long prompt at the previous version first,
so stale KV blocks would show)."""
from __future__ import annotations

import pytest
import torch

import deltasync
import engine as eng
import tiny_models as tm

VERSIONS = 3  # anchor 0, deltas 1 and 2
# TP=2 engines start worker processes (tens of seconds each on 2 cores): anchor + one delta.
VERSIONS_AT_TP2 = 2


def sparse_step(model: torch.nn.Module, step: int, share: float = 0.03) -> None:
    """Changes ~share of every tensor's bf16 elements by 1-3 ulps, as an RL step does."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            bits = p.view(-1).view(torch.int16)
            pick = (torch.rand(bits.numel(), generator=g) < share).nonzero().reshape(-1)
            bits[pick] += torch.randint(1, 4, (pick.numel(),), generator=g, dtype=torch.int16)


def publish_versions(tmp_path, kind, layout, versions):
    trainer = tm.make(kind, seed=0)
    store = f"file://{tmp_path / 'bucket'}"
    checkpoints = []
    with deltasync.DeltaPublisher(trainer, store=store, format=layout) as pub:
        for v in range(versions):
            if v:
                sparse_step(trainer, v)
            pub.publish(v)
            pub.flush()
            checkpoints.append(tm.save(trainer, tmp_path / f"v{v}"))
    return store, checkpoints


def _backend_report(worker):
    return worker.weight_transfer_engine.last_report


def follow_with_worker_extension(llm, store, v):
    if v == 0:
        reports = llm.collective_rpc("deltasync_init", args=(store, 0))
        assert all(r["served_weights_checked"] > 0 and r["index_map_bytes"] > 0 for r in reports)
    else:
        reports = llm.collective_rpc("deltasync_update", args=(v,))
    llm.reset_prefix_cache()  # the extension leaves this to its caller (documented)
    return reports


def follow_with_backend(llm, store, v, last):
    if v == 0:
        llm.init_weight_transfer_engine({"init_info": {"store": store}})
        connected = llm.collective_rpc(_backend_report)
        assert all(r["served_weights_checked"] > 0 and r["index_map_bytes"] > 0 for r in connected)
    llm.start_weight_update()
    # Versions as vLLM's HTTP routes pass them: strings, and "newest" for the last one.
    llm.update_weights({"update_info": {"version": "newest" if v == last else str(v)}})
    llm.finish_weight_update(str(v))
    assert llm.get_weight_version() == str(v)
    return llm.collective_rpc(_backend_report)


CASES = [
    pytest.param(tm.qwen3, 1, "compact", "extension", id="qwen3-tp1-compact-extension"),
    pytest.param(tm.qwen3_tied, 1, "trl", "backend", id="qwen3-tied-padded-tp1-trl-backend"),
    pytest.param(tm.qwen2_single_kv_head, 2, "compact", "backend", id="qwen2-bias-1kv-tp2-compact-backend"),
    pytest.param(tm.qwen2_single_kv_head, 2, "trl", "extension", id="qwen2-bias-1kv-tp2-trl-extension"),
    pytest.param(tm.qwen3_moe, 1, "compact", "extension", id="qwen3-moe-tp1-compact-extension"),
]


@pytest.mark.parametrize("kind, tp, layout, drive", CASES)
def test_engine_follows_store_bit_identical_to_fresh_loads(tmp_path, kind, tp, layout, drive):
    versions = VERSIONS if tp == 1 else VERSIONS_AT_TP2
    store, checkpoints = publish_versions(tmp_path, kind, layout, versions)
    start = tm.save(tm.make(kind, seed=1), tmp_path / "start")
    served = []
    options = ({"worker_extension_cls": "deltasync.vllm.DeltaWorkerExtension"} if drive == "extension"
               else {"weight_transfer_config": {"backend": "deltasync"}})
    with eng.engine(start, tp, **options) as llm:
        eng.generate(llm)  # fills the prefix cache with blocks of the start weights
        for v in range(versions):
            if drive == "extension":
                reports = follow_with_worker_extension(llm, store, v)
            else:
                reports = follow_with_backend(llm, store, v, versions - 1)
            assert len(reports) == tp and all(r["to_version"] == v for r in reports)
            if v == 0:
                assert all(r["anchor"] == 0 for r in reports)
            else:
                assert all(r["deltas"] == [v] and r["applied_elements"] > 0 for r in reports)
            served.append((eng.runtime_params(llm), eng.generate(llm)))
    for v in range(versions):
        with eng.engine(checkpoints[v], tp) as fresh:
            eng.assert_same_params(served[v][0], eng.runtime_params(fresh), f"version {v}")
            assert served[v][1] == eng.generate(fresh), f"version {v}: tokens or logprobs differ from a fresh load"
