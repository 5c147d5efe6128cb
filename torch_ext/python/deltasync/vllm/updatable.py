"""Whether a vLLM model's weights can be updated in place, decided before anything is written.

In-place updates need every checkpoint element to sit, as a plain copy, in a runtime parameter
that the forward pass reads. Two kinds of models break that and are refused with a one-line
reason:

- weights that vLLM turns into something else after loading: quantized layers (a checkpoint in
  a quantized format, or bf16 weights quantized online), and vLLM-CPU's linear layers, whose
  weights it prepacks for its own GEMM, leaving an empty Parameter behind;
- weights that vLLM re-lays out in place after loading (vLLM-CPU prepacks MoE experts into its
  grouped-GEMM layout, same shape): found by comparing the served weights, at sampled
  positions of every run of the index map, with the checkpoint the engine was started from.
"""
from __future__ import annotations

import glob
import os

import torch

from .._params import int_view
from .index_map import IndexMap, floating_tensors

SAMPLED_RUNS = 64  # per (HF tensor, runtime tensor): first, middle and last element of this many runs


class NotUpdatableError(RuntimeError):
    """The model's weights cannot be updated in place (the engine is left as it was)."""


def refuse_if_not_updatable(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            raise NotUpdatableError(f"deltasync.vllm: layer {name} is quantized by vLLM ({type(method).__name__}): "
                                    "its parameters do not hold the checkpoint's values, so deltas cannot be applied in place")
    for name, _, _, t in floating_tensors(model):
        if t.numel() == 0:
            raise NotUpdatableError(f"deltasync.vllm: runtime parameter {name} is empty: vLLM moved that layer's weights "
                                    "out of its parameters after loading (vLLM-CPU prepacks linear weights for its own "
                                    "GEMM), so deltas cannot be applied in place")


def checkpoint_files(model_path: str | None) -> list[str]:
    """The safetensors files of the checkpoint the engine was started from (a local folder, or a
    Hugging Face repository already in the local cache); [] when not found locally."""
    if not model_path:
        return []
    folder = model_path
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(model_path, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached here: nothing to compare with
            return []
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def _sample(runs) -> tuple[torch.Tensor, torch.Tensor]:
    pick = torch.linspace(0, runs.hf_start.numel() - 1, min(SAMPLED_RUNS, runs.hf_start.numel())).long().unique()
    hf, rt, n = runs.hf_start[pick], runs.rt_start[pick], runs.length[pick]
    steps = torch.stack([torch.zeros_like(n), n // 2, n - 1], dim=1)
    return (hf[:, None] + steps).reshape(-1), (rt[:, None] + steps).reshape(-1)


def check_served_weights(imap: IndexMap, files: list[str]) -> int:
    """Refuses (NotUpdatableError) when a runtime tensor does not hold the checkpoint's value at
    a sampled position of the index map. Returns the number of elements compared."""
    from safetensors import safe_open

    compared = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                for runs in imap.targets.get(name, ()):
                    runtime = imap.params[runs.param_index]
                    hf_pos, rt_pos = _sample(runs)
                    want = f.get_tensor(name).reshape(-1).index_select(0, hf_pos).to(runtime.dtype)
                    got = runtime.reshape(-1).index_select(0, rt_pos.to(runtime.device)).cpu()
                    if not torch.equal(int_view(want), int_view(got)):
                        raise NotUpdatableError(
                            f"deltasync.vllm: runtime tensor {imap.param_names[runs.param_index]} does not hold "
                            f"checkpoint tensor {name} where vLLM's loader puts it: the engine re-laid out or "
                            "transformed the weights after loading (vLLM-CPU prepacks MoE experts), so deltas "
                            "cannot be applied in place")
                    compared += hf_pos.numel()
    return compared
