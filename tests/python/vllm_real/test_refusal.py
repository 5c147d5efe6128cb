"""Set-up is failure-safe on real vLLM: a model whose weights cannot be updated in place is
refused up front with a one-line reason, and an engine whose set-up fails half way, or whose
anchor fails its verification, serves exactly what it served before (every runtime parameter,
bit for bit, and the same tokens)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import engine as eng
import tiny_models as tm
from test_follow_store import publish_versions

sys.path.insert(0, str(Path(__file__).parents[1]))
import store_tamper  # noqa: E402

EXTENSION = "deltasync.vllm.DeltaWorkerExtension"


@pytest.mark.parametrize("kind, keep_cpu_weights, reason", [
    # vLLM-CPU's linear prepacking as on AVX-512 machines (the plugin's "prepacked-linears").
    pytest.param(tm.qwen3, "prepacked-linears", r"runtime parameter \S+ is empty: vLLM moved",
                 id="prepacked-linears"),
    # Stock vLLM-CPU: MoE experts prepacked in place (and, on AVX-512 machines, linears emptied).
    pytest.param(tm.qwen3_moe, "0", r"(runtime parameter \S+ is empty: vLLM moved|runtime tensor \S+experts\S+ does "
                 r"not hold what vLLM's loader puts there)", id="stock-vllm-cpu-moe"),
])
def test_model_that_cannot_be_updated_in_place_is_refused_and_serves_as_before(tmp_path, kind, keep_cpu_weights,
                                                                                reason):
    store, _ = publish_versions(tmp_path, kind, "compact", 1)
    start = tm.save(tm.make(kind, seed=1), tmp_path / "start")
    with eng.engine(start, keep_cpu_weights=keep_cpu_weights, worker_extension_cls=EXTENSION) as llm:
        served, params = eng.generate(llm), eng.runtime_params(llm)
        with pytest.raises(Exception, match=reason) as refused:
            llm.collective_rpc("deltasync_init", args=(store,))
        reason_line = str(refused.value).split("deltasync.vllm:", 1)[1].split("', please check")[0]
        assert "\n" not in reason_line and reason_line.endswith("cannot be applied in place")
        eng.assert_same_params(eng.runtime_params(llm), params, "after the refusal")
        assert eng.generate(llm) == served


def _fail_after_loading_half(worker):
    model = worker.model_runner.get_model()
    real = model.load_weights

    def half_then_fail(weights):
        items = list(weights)
        real(items[:len(items) // 2])
        raise RuntimeError("injected loader failure")

    model.load_weights = half_then_fail
    return True


def _restore_loader(worker):
    del worker.model_runner.get_model().load_weights  # back to the class's method
    return True


def test_failure_while_learning_leaves_every_byte_as_served(tmp_path):
    store, checkpoints = publish_versions(tmp_path, tm.qwen3, "compact", 1)
    with eng.engine(tm.save(tm.make(tm.qwen3, seed=1), tmp_path / "start"), worker_extension_cls=EXTENSION) as llm:
        served, params = eng.generate(llm), eng.runtime_params(llm)
        llm.collective_rpc(_fail_after_loading_half)
        with pytest.raises(Exception, match="injected loader failure"):
            llm.collective_rpc("deltasync_init", args=(store,))
        eng.assert_same_params(eng.runtime_params(llm), params, "after the failed set-up")
        assert eng.generate(llm) == served
        # And once the loader works, the same engine sets up and serves version 0.
        llm.collective_rpc(_restore_loader)
        llm.collective_rpc("deltasync_init", args=(store,))
        llm.reset_prefix_cache()
        got = eng.runtime_params(llm)
    with eng.engine(checkpoints[0]) as fresh:
        eng.assert_same_params(got, eng.runtime_params(fresh), "version 0")


def test_refusal_at_tp2_leaves_the_engine_serving(tmp_path):
    """Both ranks refuse (their worker processes); the refusal is raised once every rank has
    replied, so the multiprocess executor's replies stay in step: the engine keeps generating
    the same tokens, and a later update call fails cleanly instead of reading a stale reply."""
    store, _ = publish_versions(tmp_path, tm.qwen2_single_kv_head, "compact", 1)
    start = tm.save(tm.make(tm.qwen2_single_kv_head, seed=1), tmp_path / "start")
    with eng.engine(start, 2, keep_cpu_weights="prepacked-linears",
                    weight_transfer_config={"backend": "deltasync"}) as llm:
        served, params = eng.generate(llm), eng.runtime_params(llm)
        with pytest.raises(Exception, match=r"runtime parameter \S+ is empty: vLLM moved"):
            llm.init_weight_transfer_engine({"init_info": {"store": store}})
        assert eng.generate(llm) == served
        llm.start_weight_update()
        with pytest.raises(RuntimeError, match=r"call init_weight_transfer_engine"):
            llm.update_weights({"update_info": {"version": 0}})
        eng.assert_same_params(eng.runtime_params(llm), params, "after the refusal")
        assert eng.generate(llm) == served


def test_anchor_that_fails_verification_leaves_every_byte_as_served(tmp_path):
    # The anchor's part has a flipped bit (its SHA-256 made to agree: the fetch succeeds, the
    # anchor's own digests refuse it). Anchors are written through the index map only after
    # they verified, so the engine serves exactly what it served before; and once the store holds
    # a good anchor, the same engine sets up and serves that version bit-identical to a fresh load.
    store, checkpoints = publish_versions(tmp_path, tm.qwen3, "compact", 1)
    folder = Path(store.removeprefix("file://"))
    good = tmp_path / "good"
    shutil.copytree(folder, good)
    store_tamper.tamper_anchor_tensor(folder, 0, "model.layers.0.mlp.down_proj.weight")
    with eng.engine(tm.save(tm.make(tm.qwen3, seed=1), tmp_path / "start"), worker_extension_cls=EXTENSION) as llm:
        served, params = eng.generate(llm), eng.runtime_params(llm)
        with pytest.raises(Exception, match="does not match"):
            llm.collective_rpc("deltasync_init", args=(store,))
        eng.assert_same_params(eng.runtime_params(llm), params, "after the refused anchor")
        assert eng.generate(llm) == served
        llm.collective_rpc("deltasync_init", args=(f"file://{good}",))
        llm.reset_prefix_cache()
        got = eng.runtime_params(llm)
    with eng.engine(checkpoints[0]) as fresh:
        eng.assert_same_params(got, eng.runtime_params(fresh), "version 0")
