"""Fake (meta) implementations of torch.ops.deltasync for FakeTensor tracing (torch.compile,
torch.export, opcheck). How many elements changed is only known at run time, so output sizes
are unbacked symbolic sizes (ctx.new_dynamic_size()).
"""
from __future__ import annotations

import torch

from . import _library

_library.load()


def _encode_outputs(current, shadow, with_base: bool):
    torch._check(len(current) > 0, lambda: "deltasync.encode: empty tensor list")
    torch._check(len(current) == len(shadow), lambda: "deltasync.encode: current and shadow differ in length")
    for cur, sh in zip(current, shadow):
        torch._check(cur.numel() == sh.numel(), lambda: "deltasync.encode: shadow numel differs")
        torch._check(cur.element_size() == sh.element_size(), lambda: "deltasync.encode: shadow width differs")
    ctx = torch.library.get_ctx()
    device = current[0].device
    changed = ctx.new_dynamic_size()
    widths = {t.element_size() for t in current}
    # One width for all tensors: the value bytes follow from the count; mixed widths need their
    # own size.
    value_bytes = changed * widths.pop() if len(widths) == 1 else ctx.new_dynamic_size()
    indices = torch.empty((changed,), dtype=torch.int64, device=device)
    values = torch.empty((value_bytes,), dtype=torch.uint8, device=device)
    counts = torch.empty((len(current),), dtype=torch.int64, device=device)
    if with_base:
        return indices, values, torch.empty((value_bytes,), dtype=torch.uint8, device=device), counts
    return indices, values, counts


@torch.library.register_fake("deltasync::encode")
def _encode_fake(current, shadow, names=None):
    return _encode_outputs(current, shadow, with_base=False)


@torch.library.register_fake("deltasync::encode_with_base")
def _encode_with_base_fake(current, shadow, names=None):
    return _encode_outputs(current, shadow, with_base=True)


@torch.library.register_fake("deltasync::apply")
def _apply_fake(targets, indices, values, counts, names=None):
    torch._check(len(targets) > 0, lambda: "deltasync.apply: empty tensor list")
    torch._check(counts.numel() == len(targets), lambda: "deltasync.apply: one count per target")
    return None


@torch.library.register_fake("deltasync::digest")
def _digest_fake(tensors):
    torch._check(len(tensors) > 0, lambda: "deltasync.digest: empty tensor list")
    return torch.empty((len(tensors),), dtype=torch.int64, device="cpu")


@torch.library.register_fake("deltasync::digest_shift")
def _digest_shift_fake(indices, old_values, new_values, counts, widths):
    return torch.empty((len(widths),), dtype=torch.int64, device="cpu")
