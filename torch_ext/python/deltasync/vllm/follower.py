"""One vLLM worker following a deltasync store: the receiver code that both the native
weight-transfer backend (backend.py) and the collective_rpc worker extension (extension.py)
drive.

    follower = StoreFollower(model, checkpoint=vllm_config.model_config.model)
    follower.connect(store_url)       # refuse, or learn the maps (nothing written)
    follower.update(version=None)     # anchor and/or deltas in place up to `version` (default newest)
    follower.start(store_url, version)  # both
"""
from __future__ import annotations

import json
import struct
import time

import torch

from .._files import TORCH_DTYPE
from .._protocol import fetch_verified
from ..subscriber import DeltaSubscriber, UpdateReport
from .receiver import MappedReceiver


def hf_tensors_of_anchor(sub: DeltaSubscriber, anchor_version: int):
    """Names, dtypes and shapes of the HF tensors, from the anchor parts' headers."""
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


def report_dict(r: UpdateReport) -> dict:
    return {"version": r.to_version, "from_version": r.from_version, "anchor": r.anchor, "deltas": r.deltas,
            "changed_elements": r.changed_elements, "applied_elements": r.applied_elements,
            "bytes": r.bytes_fetched, "seconds": r.total_seconds, "fetch_seconds": r.fetch_seconds,
            "pause_seconds": r.pause_seconds, "recovered": r.recovered}


class StoreFollower:
    def __init__(self, model: torch.nn.Module, checkpoint: str | None = None):
        self.model = model
        self.checkpoint = checkpoint
        self.subscriber: DeltaSubscriber | None = None
        self.connect_report: dict = {}

    def connect(self, store: str) -> dict:
        """Refuses a model that cannot be updated in place, or learns the index maps from the
        tensors of the store's newest anchor. Writes nothing to the weights."""
        started = time.perf_counter()
        receiver = MappedReceiver(self.model, checkpoint=self.checkpoint)
        sub = DeltaSubscriber(None, store=store, receiver=receiver)
        newest = sub.poll()
        if newest is None:
            raise RuntimeError(f"{store}: no published versions")
        anchor, _ = sub.catalog.plan(None, newest)
        receiver.learn(hf_tensors_of_anchor(sub, anchor))
        self.subscriber = sub
        self.connect_report = dict(receiver.learn_report, connect_seconds=time.perf_counter() - started)
        return self.connect_report

    def start(self, store: str, version: int | None = None) -> dict:
        """connect(), then the weights to `version` (default: the newest)."""
        started = time.perf_counter()
        self.connect(store)
        report = self.update(version)
        report.update(self.connect_report, init_seconds=time.perf_counter() - started)
        return report

    def update(self, version: int | None = None) -> dict:
        sub = self._require()
        sub.update(version)
        return report_dict(sub.last_report)

    def poll(self) -> int | None:
        return self._require().poll()

    @property
    def receiver(self) -> MappedReceiver:
        return self._require().receiver

    @property
    def version(self) -> int | None:
        return self._require().version

    def _require(self) -> DeltaSubscriber:
        if self.subscriber is None:
            raise RuntimeError("deltasync.vllm: not started: call deltasync_init(store) / init_weight_transfer_engine first")
        return self.subscriber
