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

With {"init_info": {"store": URL, "follow": true}} the engine follows the store by itself: new
versions are applied between engine steps, within an optional staleness bound, and reported as
the served weight version (follow.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .._library import native
from . import rank_failures
from .worker_subscriber import WorkerSubscriber, tensor_parallel_group

NEWEST = "newest"


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    store: str  # file:///…, s3://…, http(s)://… (see deltasync's store URLs)
    # Follow the store on the engine's own time (follow.py; run by the engine core, not here).
    follow: bool = False
    poll_seconds: float = 1.0
    max_staleness_seconds: float | None = None


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    version: int | str = NEWEST


def parse_version(value) -> int | None:
    """int, its decimal string, or "newest" (None)."""
    if value is None or value == NEWEST:
        return None
    if isinstance(value, bool):
        raise ValueError(f"deltasync: version {value!r}: give an integer or {NEWEST!r}")
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and (parsed := native().try_parse_decimal(value)) is not None:
        return parsed  # the C++ number rule: digits only (no sign, no spaces)
    raise ValueError(f"deltasync: version {value!r}: give an integer or {NEWEST!r}")


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.subscriber: WorkerSubscriber | None = None
        self._store_to_connect: str | None = None  # following an empty store: connect at the first update
        self.last_report: dict | None = None

    # Failures are kept for the engine core, not raised here (rank_failures.py: a raise on one
    # rank desynchronizes vLLM's multiprocess executor); the engine core raises them.

    def parse_init_info(self, init_dict):
        return rank_failures.recorded(self, super().parse_init_info, init_dict)

    def init_transfer_engine(self, init_info: DeltaSyncInitInfo | None) -> None:
        if init_info is not None:  # None: parse_init_info failed (kept)
            rank_failures.recorded(self, self._connect, init_info)

    def _connect(self, init_info: DeltaSyncInitInfo) -> None:
        self.subscriber, self._store_to_connect = None, None
        if init_info.follow and native().StoreWatcher(init_info.store).newest() is None:
            # Following a store nothing is published to yet: the maps are learned from the
            # first version's anchor, at its update (the engine core starts it when it appears).
            self._store_to_connect = init_info.store
            return
        self._connect_to(init_info.store)

    def _connect_to(self, store: str) -> None:
        group, rank = tensor_parallel_group()
        sub = WorkerSubscriber(self.model, checkpoint=getattr(self.model_config, "model", None), group=group, rank=rank)
        self.last_report = sub.connect(store)
        self.subscriber, self._store_to_connect = sub, None

    def start_weight_update(self) -> None:
        pass  # nothing to prepare: every update is applied in place by receive_weights

    def update_weights(self, update_info: dict) -> None:
        rank_failures.recorded(self, lambda: self.receive_weights(self.parse_update_info(update_info)))

    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        if self.subscriber is None and self._store_to_connect is not None:
            self._connect_to(self._store_to_connect)
        self.last_report = self._require().update(parse_version(update_info.version))

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        self.subscriber, self._store_to_connect = None, None

    def _require(self) -> WorkerSubscriber:
        if self.subscriber is None:
            raise RuntimeError("deltasync: call init_weight_transfer_engine({'init_info': {'store': URL}}) first")
        return self.subscriber
