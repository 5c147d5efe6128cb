"""The native vLLM weight-transfer backend "deltasync" (vLLM >= 0.26's WeightTransferEngine):

    llm = LLM(model, weight_transfer_config={"backend": "deltasync"})
    llm.init_weight_transfer_engine({"init_info": {"store": "s3://bucket/run"}})  # learn, write nothing
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 7}})       # or "newest"; strings accepted ("7")
    llm.finish_weight_update("7")

and the same through `vllm serve --weight-transfer-config '{"backend":"deltasync"}'` and its
/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update routes.
Registered in every vLLM process by the plugin entry point (plugin.py); the prefix cache is reset
after every update there. Each worker brings its own shard of the weights to the version from
the store (no trainer connection) through the same worker subscriber as the worker extension
(worker_subscriber.py: the C++ mapped receiver, verified across the tensor-parallel group);
"newest" is resolved once, by rank 0 of that group.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .worker_subscriber import WorkerSubscriber, tensor_parallel_group

NEWEST = "newest"


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    store: str  # file:///…, s3://…, http(s)://… (see deltasync's store URLs)


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    version: int | str = NEWEST


def parse_version(value) -> int | None:
    """int, its decimal string, or "newest" (None)."""
    if value is None or value == NEWEST:
        return None
    if isinstance(value, bool):
        raise ValueError(f"deltasync: version {value!r}: give an integer or {NEWEST!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"deltasync: version {value!r}: give an integer or {NEWEST!r}")


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.subscriber: WorkerSubscriber | None = None
        self.last_report: dict | None = None

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo) -> None:
        group, rank = tensor_parallel_group()
        sub = WorkerSubscriber(self.model, checkpoint=getattr(self.model_config, "model", None), group=group, rank=rank)
        self.last_report = sub.connect(init_info.store)
        self.subscriber = sub

    def start_weight_update(self) -> None:
        self._require()

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        self.last_report = self._require().update(parse_version(update_info.version))

    def finish_weight_update(self) -> None:
        self._require()

    def shutdown(self) -> None:
        self.subscriber = None

    def _require(self) -> WorkerSubscriber:
        if self.subscriber is None:
            raise RuntimeError("deltasync: call init_weight_transfer_engine({'init_info': {'store': URL}}) first")
        return self.subscriber
