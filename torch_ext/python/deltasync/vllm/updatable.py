"""Whether a vLLM model's weights can be updated in place, decided before anything is written.

In-place updates need every checkpoint element to sit, as a plain copy, in a runtime parameter
that the forward pass reads. Two kinds of models break that and are refused with a one-line
reason:

- weights that vLLM turns into something else after loading: quantized layers (a checkpoint in
  a quantized format, or bf16 weights quantized online), and vLLM-CPU's linear layers, whose
  weights it prepacks for its own GEMM, leaving an empty Parameter behind;
- weights that vLLM re-lays out in place after loading (vLLM-CPU prepacks MoE experts into its
  grouped-GEMM layout, same shape): found by loading the checkpoint the engine was started
  from, through vLLM's own loader, into copies of the runtime tensors and comparing them with
  the served ones.
"""
from __future__ import annotations

import glob
import os

import torch

from .._params import int_view
from .index_map import data_swapped, floating_tensors


class NotUpdatableError(RuntimeError):
    """The model's weights cannot be updated in place (the engine is left as it was). `tensor`:
    the runtime parameter or layer that decided it."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


def refuse_if_not_updatable(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            raise NotUpdatableError(f"deltasync.vllm: layer {name} is quantized by vLLM ({type(method).__name__}): "
                                    "its parameters do not hold the checkpoint's values, so deltas cannot be applied in place",
                                    tensor=name)
    for name, _, _, t in floating_tensors(model):
        if t.numel() == 0:
            raise NotUpdatableError(f"deltasync.vllm: runtime parameter {name} is empty: vLLM moved that layer's weights "
                                    "out of its parameters after loading (vLLM-CPU prepacks linear weights for its own "
                                    "GEMM), so deltas cannot be applied in place", tensor=name)


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


def _checkpoint_tensors(files: list[str]):
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def check_served_weights(model: torch.nn.Module, files: list[str], load_weights=None) -> int:
    """Refuses (NotUpdatableError) a model whose served weights are not what vLLM's own loader
    puts in its parameters from the checkpoint the engine was started from: the checkpoint is
    loaded, through load_weights, into copies of the runtime tensors (the live ones are not
    written), and every copy must equal its live tensor bit for bit. Returns the elements compared."""
    load = load_weights or model.load_weights
    tensors = floating_tensors(model)
    copies = [t.detach().clone() for _, _, _, t in tensors]
    with data_swapped([t for _, _, _, t in tensors], copies):
        load(_checkpoint_tensors(files))
    for (name, _, _, t), copy in zip(tensors, copies):
        if not torch.equal(int_view(copy), int_view(t.data)):
            raise NotUpdatableError(
                f"deltasync.vllm: runtime tensor {name} does not hold what vLLM's loader puts there from the engine's "
                "checkpoint: the engine re-laid out or transformed the weights after loading (vLLM-CPU prepacks MoE "
                "experts), so deltas cannot be applied in place", tensor=name)
    return sum(c.numel() for c in copies)
