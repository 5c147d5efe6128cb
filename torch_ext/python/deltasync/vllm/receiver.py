"""MappedReceiver: applies HF-named anchors and deltas to a vLLM model's runtime parameters.

The DeltaSubscriber drives it (learn once, then load_anchor / parse_delta / apply_delta); the
vLLM-facing entry points (the weight-transfer backend, the worker extension) only build it.

- learn: refuses a model whose weights cannot be updated in place, learns the index maps on
  twins (index_map.py) and, when the engine's checkpoint is at hand, checks at sampled
  positions that the served weights are where the maps say (updatable.py). Nothing is written.
- load_anchor: checks every tensor of the part (known, dtype, shape) before writing any, then
  copies each through the maps (run by run, no full-model staging).
- apply_delta: one mapping of the whole delta (delta_map.py) and one deltasync apply.
"""
from __future__ import annotations

import time

import torch

from .. import ops
from .._files import ParsedDelta, parse_delta, rebase_values
from .._params import int_view
from ..subscriber import UpdateReport
from .delta_map import DeltaMap
from .index_map import IndexMap, learn_index_maps
from .updatable import check_served_weights, checkpoint_files, refuse_if_not_updatable


class MappedReceiver:
    """Applies HF-named anchors and deltas to a vLLM model's runtime parameters."""

    verifies_digests = False

    def __init__(self, model: torch.nn.Module, checkpoint: str | None = None):
        self.model = model
        self.checkpoint = checkpoint  # what the engine was started from (checked against the served weights)
        self.index_map: IndexMap | None = None
        self.delta_map: DeltaMap | None = None
        self.hf_meta: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.learn_report: dict = {}

    def learn(self, hf_tensors) -> None:
        started = time.perf_counter()
        refuse_if_not_updatable(self.model)
        files = checkpoint_files(self.checkpoint)
        compared = check_served_weights(self.model, files) if files else 0
        checked = time.perf_counter()
        imap = learn_index_maps(self.model, hf_tensors)
        learned = time.perf_counter()
        self.index_map, self.delta_map = imap, DeltaMap(imap)
        self.hf_meta = [(n, dtype, tuple(shape)) for n, (dtype, shape) in hf_tensors.items()]
        self.learn_report = {"check_seconds": checked - started, "learn_seconds": learned - checked,
                             "map_seconds": time.perf_counter() - learned,
                             "served_weights_checked": compared,
                             "index_map": imap.describe(), "index_map_bytes": imap.bytes()}

    def load_anchor(self, tensors: dict[str, torch.Tensor], label: str) -> None:
        imap = self.index_map
        for name, t in tensors.items():
            if name not in imap.hf_tensors:
                raise ValueError(f"{label}: tensor {name} is not one the worker mapped")
            dtype, shape = imap.hf_tensors[name]
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{label}: tensor {name} is {t.dtype}{list(t.shape)}, the mapped one is "
                                 f"{dtype}{list(shape)}")
        imap.write_zero_fills()  # what vLLM's loaders fill with zeros (padding), as a fresh load does
        for name, t in tensors.items():
            for runs in imap.targets[name]:
                target = imap.params[runs.param_index]
                runs.copy_into(target, t.to(target.device))

    def parse_delta(self, data: bytes, label: str) -> ParsedDelta:
        # HF-shaped tensors are not held here: a compact delta comes back relative, and
        # apply_delta gathers the base bits from the runtime parameters it writes.
        return parse_delta(data, label, self.hf_meta)

    def check_anchor(self, expected, label) -> None:  # pragma: no cover - digests not verifiable here
        pass

    def apply_delta(self, delta: ParsedDelta, label: str, report: UpdateReport) -> None:
        imap = self.index_map
        unknown = [n for n in delta.changed if n not in imap.targets]
        if unknown:
            raise ValueError(f"{label}: tensor {unknown[0]} is not one the worker mapped")
        names = self.delta_map.names_in_order(delta.changed)
        same_dtypes = all(delta.changed[n][1].dtype == imap.params[t.param_index].dtype
                          for n in names for t in imap.targets[n])
        widths = {delta.changed[n][1].element_size() for n in names}
        if names and same_dtypes and len(widths) == 1:
            self._apply_vectorized(delta, names, widths.pop(), report)
        else:
            self._apply_per_tensor(delta, label, report)

    def _apply_vectorized(self, delta: ParsedDelta, names: list[str], width: int, report: UpdateReport) -> None:
        """The whole delta in O(1) kernel launches: one copy of indices and of values to the
        device, one table lookup, one scatter."""
        imap = self.index_map
        started = time.perf_counter()
        device = imap.params[0].device
        counts = torch.tensor([delta.changed[n][0].numel() for n in names], dtype=torch.int64)
        indices = torch.cat([delta.changed[n][0] for n in names])
        values = torch.cat([delta.changed[n][1].reshape(-1).view(torch.uint8) for n in names])
        if device.type == "cuda":
            indices = indices.pin_memory().to(device, non_blocking=True)
            values = values.pin_memory().to(device, non_blocking=True)
        rows, local, per_param = self.delta_map.map(names, indices, counts)
        if rows is not None:
            values = values.view(-1, width).index_select(0, rows).reshape(-1)
        written = local.numel()
        if delta.relative:
            # Compact: values are coded against the base bits, which sit at the runtime
            # positions about to be written (only those this rank holds are needed).
            base = torch.cat([int_view(p).index_select(0, pos).view(torch.uint8)
                              for p, pos in zip(imap.params, torch.split(local, per_param.tolist()))])
            values = rebase_values(values, base, [written], [width])
            values = values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values
        if written:
            touched = per_param.nonzero().reshape(-1).tolist()
            ops.apply([imap.params[k] for k in touched], local, values, per_param[touched].cpu(),
                      [imap.param_names[k] for k in touched])
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        report.pause_seconds += time.perf_counter() - started
        report.changed_elements += int(counts.sum())
        report.applied_elements += written

    def _apply_per_tensor(self, delta: ParsedDelta, label: str, report: UpdateReport) -> None:
        """Fallback when value dtypes differ from the runtime parameters' (values are cast)."""
        imap = self.index_map
        started = time.perf_counter()
        device = imap.params[0].device
        names = [n for n in delta.changed if imap.targets.get(n)]
        if not names:
            report.pause_seconds += time.perf_counter() - started
            return
        counts = [delta.changed[n][0].numel() for n in names]
        all_indices = torch.cat([delta.changed[n][0] for n in names])
        all_indices = all_indices.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else all_indices
        per_name_indices = torch.split(all_indices, counts)
        positions: dict[int, list[torch.Tensor]] = {}
        values: dict[int, list[torch.Tensor]] = {}
        for name, idx in zip(names, per_name_indices):
            v = delta.changed[name][1]
            v = v.to(device, non_blocking=True) if device.type == "cuda" else v
            for target in imap.targets[name]:
                held, pos = target.lookup(idx)
                param = imap.params[target.param_index]
                new = v[held]
                if delta.relative:
                    new = _rebase_from_runtime(new, param, pos, label, name)
                positions.setdefault(target.param_index, []).append(pos)
                values.setdefault(target.param_index, []).append(new.to(param.dtype))
        order = sorted(positions)
        targets, idx_parts, val_parts, n_parts = [], [], [], []
        for k in order:
            pos = torch.cat(positions[k])
            val = torch.cat(values[k])
            if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
                # q, k and v (or gate and up) changes arrive per HF tensor; merge them in order.
                pos, perm = torch.sort(pos)
                val = val[perm]
            targets.append(imap.params[k])
            idx_parts.append(pos)
            val_parts.append(val.reshape(-1).view(torch.uint8))
            n_parts.append(pos.numel())
        ops.apply(targets, torch.cat(idx_parts), torch.cat(val_parts), torch.tensor(n_parts, dtype=torch.int64),
                  [imap.param_names[k] for k in order])
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        report.pause_seconds += time.perf_counter() - started
        report.changed_elements += int(all_indices.numel())
        report.applied_elements += sum(n_parts)


def _rebase_from_runtime(unbased: torch.Tensor, param: torch.Tensor, pos: torch.Tensor, label: str,
                         name: str) -> torch.Tensor:
    """New values (published dtype) of a compact delta whose runtime parameter has another
    dtype: the base bits are the runtime values cast back to the published dtype, which is exact
    only when the runtime dtype holds every published value (bf16 served in fp32); refused
    otherwise rather than guessed."""
    runtime = param.view(-1).index_select(0, pos)
    base = runtime.to(unbased.dtype)
    if not torch.equal(int_view(base.to(param.dtype)), int_view(runtime)):
        raise RuntimeError(f"{label}: tensor {name}: compact-layout delta, and the runtime {param.dtype} values do "
                           f"not convert exactly back to the published {unbased.dtype} base bits its values are "
                           "coded against; publish with format='trl'")
    new = rebase_values(unbased, base, [unbased.numel()], [unbased.element_size()]).view(unbased.dtype)
    return new.to(param.device)
