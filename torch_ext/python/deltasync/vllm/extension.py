"""DeltaWorkerExtension: methods vLLM mixes into every worker (--worker-extension-cls) and that
the engine calls with collective_rpc:

    deltasync_init(store, version=None)  learn the HF -> runtime index maps through the model's
                                         own loaders, load the newest anchor via load_weights,
                                         then apply deltas up to `version`; returns a report
    deltasync_update(version=None)       apply deltas in place up to `version` (default newest);
                                         returns {version, bytes, seconds, pause_seconds, ...}
    deltasync_poll()                     newest visible version in the store
    deltasync_version()                  version the weights are at

Each delta is applied with one torch.ops.deltasync.apply over the runtime parameters it
touches: no CPU snapshot of the weights, no full-tensor rebuild; memory is O(changed) plus the
index maps (runs). Objects are checked against their SHA-256 and version links; per-tensor
digests are not (they describe HF-shaped tensors a TP rank does not hold).
"""
from __future__ import annotations

import time

import torch

from .. import ops
from .._files import ParsedDelta, parse_delta, rebase_values
from .._params import int_view
from ..subscriber import DeltaSubscriber, UpdateReport
from .index_map import GlobalMap, IndexMap, learn_index_maps


class MappedReceiver:
    """Applies HF-named anchors and deltas to a vLLM model's runtime parameters."""

    verifies_digests = False

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.index_map: IndexMap | None = None
        self.global_map: GlobalMap | None = None
        self.hf_meta: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def learn(self, hf_tensors) -> None:
        self.hf_meta = [(n, dtype, tuple(shape)) for n, (dtype, shape) in hf_tensors.items()]
        self.index_map = learn_index_maps(self.model, hf_tensors)
        self.global_map = GlobalMap(self.index_map, self.index_map.params[0].device)

    def load_anchor(self, tensors: dict[str, torch.Tensor], label: str) -> None:
        # vLLM's own path for full weights.
        self.model.load_weights(list(tensors.items()))

    def parse_delta(self, data: bytes, label: str) -> ParsedDelta:
        # HF-shaped tensors are not held here: a compact delta comes back relative, and
        # _apply_vectorized gathers the base bits from the runtime parameters it writes.
        return parse_delta(data, label, self.hf_meta)

    def check_anchor(self, expected, label) -> None:  # pragma: no cover - digests not verifiable here
        pass

    def apply_delta(self, delta: ParsedDelta, label: str, report: UpdateReport) -> None:
        imap = self.index_map
        unknown = [n for n in delta.changed if n not in imap.targets]
        if unknown:
            raise ValueError(f"{label}: tensor {unknown[0]} is not one the worker mapped")
        names = [n for n in delta.changed if imap.targets[n]]
        same_dtypes = all(delta.changed[n][1].dtype == imap.params[t.param_index].dtype
                          for n in names for t in imap.targets[n])
        widths = {delta.changed[n][1].element_size() for n in names}
        if names and same_dtypes and len(widths) == 1:
            self._apply_vectorized(delta, names, widths.pop(), report)
        else:
            self._apply_per_tensor(delta, label, report)

    def _apply_vectorized(self, delta: ParsedDelta, names: list[str], width: int, report: UpdateReport) -> None:
        """The whole delta in O(1) kernel launches: one copy of indices and of values to the
        device, one binary search over all runs, (at most) one sort, one scatter."""
        gmap, imap = self.global_map, self.index_map
        started = time.perf_counter()
        device = imap.params[0].device
        counts = torch.tensor([delta.changed[n][0].numel() for n in names], dtype=torch.int64)
        bases = torch.tensor([gmap.hf_base[n] for n in names], dtype=torch.int64)
        global_hf = torch.cat([delta.changed[n][0] for n in names]) + torch.repeat_interleave(bases, counts)
        values = torch.cat([delta.changed[n][1].reshape(-1).view(torch.uint8) for n in names])
        if device.type == "cuda":
            global_hf = global_hf.pin_memory().to(device, non_blocking=True)
            values = values.pin_memory().to(device, non_blocking=True)
        rows, positions = gmap.map(global_hf)
        order, local, per_param = gmap.split(positions)
        if order is not None:
            rows = rows[order]
        values = values.view(-1, width).index_select(0, rows).reshape(-1)
        if delta.relative:
            # Compact: values are coded against the base bits, which sit at the runtime
            # positions about to be written (only those this rank holds are needed).
            per_param_list = per_param.tolist()
            base = torch.cat([int_view(p).index_select(0, pos).view(torch.uint8)
                              for p, pos in zip(imap.params, torch.split(local, per_param_list))])
            values = rebase_values(values, base, [int(rows.numel())], [width])
            values = values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values
        ops.apply(imap.params, local, values, per_param, imap.param_names)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        report.pause_seconds += time.perf_counter() - started
        report.changed_elements += int(counts.sum())
        report.applied_elements += int(rows.numel())

    def _apply_per_tensor(self, delta: ParsedDelta, label: str, report: UpdateReport) -> None:
        """Fallback when value dtypes differ from the runtime parameters' (values are cast)."""
        imap = self.index_map
        started = time.perf_counter()
        device = imap.params[0].device
        # One host->device copy for all indices and one per value dtype.
        names = [n for n in delta.changed if imap.targets.get(n)]
        unknown = [n for n in delta.changed if n not in imap.targets]
        if unknown:
            raise ValueError(f"{label}: tensor {unknown[0]} is not one the worker mapped")
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


def _hf_tensors_of_anchor(sub: DeltaSubscriber, anchor_version: int):
    """Names, dtypes and shapes of the HF tensors, from the anchor parts' headers."""
    import json
    import struct

    from .._files import TORCH_DTYPE
    from .._protocol import fetch_verified

    m = sub.catalog.find(anchor_version)
    out = {}
    for ref in m.anchor_parts:
        data = fetch_verified(sub.store, ref)
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (TORCH_DTYPE[info["dtype"]], tuple(info["shape"]))
    return out


class DeltaWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _deltasync_model(self) -> torch.nn.Module:
        runner = getattr(self, "model_runner", None)
        # get_model() unwraps what recent vLLM wraps around the model (CUDA-graph wrappers).
        model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
        if model is None:
            raise RuntimeError("deltasync.vllm: cannot find the worker's model (model_runner.model)")
        return model

    def deltasync_init(self, store: str, version: int | None = None) -> dict:
        started = time.perf_counter()
        receiver = MappedReceiver(self._deltasync_model())
        sub = DeltaSubscriber(None, store=store, receiver=receiver)
        target = sub.poll() if version is None else version
        if target is None:
            raise RuntimeError(f"{store}: no published versions")
        anchor, _ = sub.catalog.plan(None, target)
        t0 = time.perf_counter()
        receiver.learn(_hf_tensors_of_anchor(sub, anchor))
        learn_seconds = time.perf_counter() - t0
        sub.update(target)
        self._deltasync = sub
        report = self._deltasync_report(sub.last_report)
        report.update(init_seconds=time.perf_counter() - started, learn_seconds=learn_seconds,
                      index_map=receiver.index_map.describe(), index_map_bytes=receiver.index_map.bytes())
        return report

    def deltasync_update(self, version: int | None = None) -> dict:
        sub = self._deltasync_subscriber()
        sub.update(version)
        return self._deltasync_report(sub.last_report)

    def deltasync_poll(self) -> int | None:
        return self._deltasync_subscriber().poll()

    def deltasync_version(self) -> int | None:
        return self._deltasync_subscriber().version

    def _deltasync_subscriber(self) -> DeltaSubscriber:
        sub = getattr(self, "_deltasync", None)
        if sub is None:
            raise RuntimeError("deltasync.vllm: call deltasync_init(store) first")
        return sub

    @staticmethod
    def _deltasync_report(r: UpdateReport) -> dict:
        return {"version": r.to_version, "from_version": r.from_version, "anchor": r.anchor, "deltas": r.deltas,
                "changed_elements": r.changed_elements, "applied_elements": r.applied_elements, "bytes": r.bytes_fetched, "seconds": r.total_seconds,
                "fetch_seconds": r.fetch_seconds, "pause_seconds": r.pause_seconds}
