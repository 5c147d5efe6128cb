"""Named tensors from a model, a dict or (name, tensor) pairs: what publisher and subscriber work on.
The C++ library checks dtypes, devices and layout; this only collects the tensors -- the tensors
themselves, not detached aliases, so that the library sees a later `param.data = ...` (a new
dtype, shape or memory) and refuses it instead of working on the memory the alias kept."""
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
    return items


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
