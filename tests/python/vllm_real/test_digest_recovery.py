"""The C++ mapped receiver verifies what it writes into a real vLLM engine's parameters: a write
into the served weights behind its back, at an element the next delta changes, makes that
delta's result digest fail; the delta is rolled back and the receiver recovers from the anchor,
ending bit-identical to a fresh vLLM load of the version."""
from __future__ import annotations

import torch

import deltasync
import engine as eng
import tiny_models as tm

EXTENSION = "deltasync.vllm.DeltaWorkerExtension"


def _corrupt_final_norm(worker):
    # model.norm.weight is a plain copy of the HF tensor in vLLM's Qwen3 (one run, same positions).
    params = dict(worker.model_runner.get_model().named_parameters())
    with torch.no_grad():
        params["model.norm.weight"].view(torch.int16)[3] += 7
    return True


def test_write_behind_the_receivers_back_is_caught_rolled_back_and_recovered(tmp_path):
    trainer = tm.make(tm.qwen3, seed=0)
    store = f"file://{tmp_path / 'bucket'}"
    with deltasync.DeltaPublisher(trainer, store=store) as pub:
        pub.publish(0)
        pub.flush()
        with eng.engine(tm.save(tm.make(tm.qwen3, seed=1), tmp_path / "start"), worker_extension_cls=EXTENSION) as llm:
            llm.collective_rpc("deltasync_init", args=(store, 0))
            with torch.no_grad():
                trainer.model.norm.weight.view(torch.int16)[3] += 1
            pub.publish(1)
            pub.flush()
            llm.collective_rpc(_corrupt_final_norm)
            (report,) = llm.collective_rpc("deltasync_update", args=(1,))
            got = eng.runtime_params(llm)
    assert report["to_version"] == 1 and report["anchor"] == 0, report
    assert report["recovered"] and "digest" in report["recovered"], report["recovered"]
    with eng.engine(tm.save(trainer, tmp_path / "v1")) as fresh:
        eng.assert_same_params(got, eng.runtime_params(fresh), "version 1")
