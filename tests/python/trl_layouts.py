"""An independent writer and reader of TRL's two sparse delta layouts, written from their
description (docs/trl-formats.md), not from deltasync's C++: numpy for the index arithmetic,
torch + safetensors for the container, exactly as a TRL user's code would produce or consume it.

- blog layout: NAME.indices (int32 flat positions) + NAME.values, metadata sparse,
  model_version, sparsity, changed_params.
- branch layout: NAME.idx + NAME.val, metadata format="sparse_weight_patch", version="1",
  sparse, model_version, num_changed_params, total_changed_elements, total_elements, sparsity,
  encoding; `raw` stores int32 positions, `gap_delta` stores idx[k] - idx[k-1] - 1 (idx[-1] = -1)
  as uint16, or as uint32 for a tensor whose largest gap does not fit uint16.
"""
from __future__ import annotations

import json

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.element_size()]).flatten()


def changed_positions(base: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    """Ascending flat positions whose bit patterns differ."""
    return torch.nonzero(bits(base) != bits(new)).flatten().numpy().astype(np.int64)


def gap_encode(positions: np.ndarray) -> np.ndarray:
    previous = np.concatenate([[-1], positions[:-1]]).astype(np.int64)
    gaps = positions.astype(np.int64) - previous - 1
    return gaps.astype(np.uint16 if gaps.size == 0 or gaps.max() <= 0xFFFF else np.uint32)


def gap_decode(gaps: np.ndarray) -> np.ndarray:
    return np.cumsum(gaps.astype(np.int64) + 1) - 1


def write_blog_delta(path, base: dict, new: dict, model_version: int) -> None:
    tensors, changed, total_changed, total = {}, [], 0, 0
    for name, b in base.items():
        total += b.numel()
        pos = changed_positions(b, new[name])
        if pos.size == 0:
            continue
        tensors[f"{name}.indices"] = torch.from_numpy(pos.astype(np.int32))
        tensors[f"{name}.values"] = new[name].flatten()[torch.from_numpy(pos)].clone()
        changed.append(name)
        total_changed += pos.size
    save_file(tensors, str(path), metadata={"sparse": "True", "model_version": str(model_version),
                                            "sparsity": str(1.0 - total_changed / max(total, 1)),
                                            "changed_params": json.dumps(changed)})


def write_branch_delta(path, base: dict, new: dict, model_version: int, encoding: str,
                       keep_unchanged: bool = True) -> None:
    """Like TRL's branch writer: one pair per tensor it was handed (empty for an unchanged one
    when keep_unchanged), values in the tensor's dtype."""
    tensors, params, total_changed, total = {}, 0, 0, 0
    for name, b in base.items():
        total += b.numel()
        pos = changed_positions(b, new[name])
        if pos.size == 0 and not keep_unchanged:
            continue
        idx = pos.astype(np.int32) if encoding == "raw" else gap_encode(pos)
        tensors[f"{name}.idx"] = torch.from_numpy(idx)
        tensors[f"{name}.val"] = new[name].flatten()[torch.from_numpy(pos)].clone()
        params += 1
        total_changed += pos.size
    metadata = {"format": "sparse_weight_patch", "version": "1", "sparse": "True",
                "model_version": str(model_version), "num_changed_params": str(params),
                "total_changed_elements": str(total_changed), "total_elements": str(total),
                "sparsity": str(1.0 - total_changed / max(total, 1)), "encoding": encoding}
    save_file(tensors, str(path), metadata=metadata)


def read_delta(path) -> tuple[dict[str, str], dict[str, tuple[np.ndarray, torch.Tensor]]]:
    """Either layout: (metadata, name -> (int64 positions, values))."""
    out = {}
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata() or {}
        keys = set(f.keys())
        if md.get("format") == "sparse_weight_patch":
            encoding = md.get("encoding", "gap_delta")
            for name in sorted(k[: -len(".val")] for k in keys if k.endswith(".val")):
                idx = f.get_tensor(f"{name}.idx").numpy()
                if encoding == "raw":
                    assert idx.dtype in (np.int32, np.int64), idx.dtype
                    pos = idx.astype(np.int64)
                else:
                    assert encoding == "gap_delta" and idx.dtype in (np.uint16, np.uint32), (encoding, idx.dtype)
                    pos = gap_decode(idx)
                out[name] = (pos, f.get_tensor(f"{name}.val"))
        else:
            for name in sorted(k[: -len(".values")] for k in keys if k.endswith(".values")):
                out[name] = (f.get_tensor(f"{name}.indices").numpy().astype(np.int64), f.get_tensor(f"{name}.values"))
    return md, out


def apply_delta(base: dict, changes: dict) -> dict:
    """Base tensors with the changes written at their positions (new tensors; base untouched)."""
    out = {}
    for name, t in base.items():
        flat = t.clone().flatten()
        if name in changes:
            pos, values = changes[name]
            flat[torch.from_numpy(pos)] = values.to(t.dtype)
        out[name] = flat.reshape(t.shape)
    return out
