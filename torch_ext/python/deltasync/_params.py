"""Named tensors from a model, a dict or (name, tensor) pairs: what publisher and subscriber work on."""
from __future__ import annotations

from typing import Mapping

import torch


def named_tensors(source) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, torch.nn.Module):
        items = list(source.named_parameters())
    elif isinstance(source, Mapping):
        items = list(source.items())
    else:
        items = list(source)
    if not items:
        raise ValueError("deltasync: no tensors given")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("deltasync: duplicate tensor names")
    out = []
    for name, t in items:
        t = t.detach()
        if t.element_size() not in (1, 2, 4):
            raise ValueError(f"deltasync: tensor {name}: dtype {t.dtype} is not a 1/2/4-byte weight dtype")
        if not t.is_contiguous():
            raise ValueError(f"deltasync: tensor {name} is not contiguous")
        out.append((name, t))
    devices = {t.device for _, t in out}
    if len(devices) != 1:
        raise ValueError(f"deltasync: tensors live on several devices {sorted(map(str, devices))}; use one per device")
    return out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy; from a GPU through pinned memory without blocking (caller synchronizes)."""
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)

