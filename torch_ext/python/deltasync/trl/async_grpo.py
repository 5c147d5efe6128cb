"""TRL's experimental AsyncGRPOTrainer on deltasync, asynchronous end to end: the trainer only
publishes each version to the store (the delta's staging, the upload in the background), and a
stock `vllm serve` with the deltasync backend follows the store on its own time (follow mode,
deltasync/vllm/follow.py); no pause, no update call, no NCCL.

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --enable-scale-out \\
        --weight-transfer-config '{"backend": "deltasync"}'
    from deltasync.trl import DeltaSyncAsyncGRPOTrainer
    trainer = DeltaSyncAsyncGRPOTrainer(model=PATH, args=AsyncGRPOConfig(vllm_server_base_url=URL, ...),
                                        reward_funcs=..., train_dataset=..., deltasync_store="s3://bucket/run")

Under follow mode the version the trainer last announced is not the one that generated a
rollout: the server may still serve an older one, or move to a newer one in the middle of a
completion. So the rollout worker generates through vLLM's token route /inference/v1/generate
(registered with --enable-scale-out), whose every choice carries `weight_versions` (the version
that sampled each span of output tokens), and tags each group with the oldest version that
sampled any of its tokens. TRL's `max_staleness` then compares the trainer's version with that
served one.

TRL 1.16 trains with `attn_implementation="tree_fa3"` (FlashAttention-3 from the Hub, GPU only).
`tree_attention="sdpa"` (the default where CUDA is absent) registers sdpa_tree_attention under
that name instead: the same tree-packed attention through torch's scaled_dot_product_attention."""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from .sync import WeightSyncReport
from .vllm_server import VLLMServerEngine
from .weight_transfer import DeltaWeightTransfer

def sdpa_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                        tree_cu_seqlens_k, tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None,
                        sliding_window=None, softcap=None, **kwargs):
    """TRL's tree attention (trl/experimental/async_grpo/packing.py, tree_attention) through
    torch's SDPA: segment s's queries (packed rows tree_cu_seqlens_q[s]..[s+1]) attend the keys
    of its root-to-segment path (tree_kv_index[tree_cu_seqlens_k[s]..[s+1]]), causally aligned
    at the end of the path, as flash_attn_varlen_func(causal=True) does when the query is the
    path's last rows."""
    if softcap:
        raise ValueError("deltasync.trl.sdpa_tree_attention: attention softcapping is not supported")
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # (tokens, heads, head_dim)
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves a block of query heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = torch.empty_like(q)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        lq, lk = q1 - q0, k1 - k0
        rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        cols = torch.arange(lk, device=q.device)[None, :]
        allowed = cols <= rows
        if sliding_window:
            allowed &= cols > rows - sliding_window
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
            attn_mask=allowed, scale=scaling).transpose(0, 1)
    return out.unsqueeze(0), None


def use_sdpa_tree_attention() -> None:
    """Registers sdpa_tree_attention as transformers' "tree_fa3" attention (and, as TRL's
    register_tree_attention does, no mask function: the tree is the mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    AttentionInterface.register(TREE_ATTENTION, sdpa_tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda **kwargs: None)


@contextlib.contextmanager
def _building_trainer_with(worker_class, cpu_twins: bool):
    """AsyncGRPOTrainer.__init__ builds `AsyncRolloutWorker(...)` by its module's name: swapped for
    its time. The worker's vLLM import check is lifted too: it talks to the server over HTTP only.
    With `cpu_twins`, the tree attention it registers is sdpa_tree_attention and the peak-FLOPs
    lookup for its MFU metric (torch.cuda.get_device_name) answers None, as for an unknown GPU."""
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker

    swaps = [(async_grpo_trainer, "AsyncRolloutWorker", worker_class),
             (async_rollout_worker, "is_vllm_available", lambda: True)]
    if cpu_twins:
        swaps += [(async_grpo_trainer, "register_tree_attention", use_sdpa_tree_attention),
                  (async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, value in swaps:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class _ConsumedLog:
    """The trainer's rollout queue, recording (served version, trainer version) of every sample
    the trainer takes, before TRL's staleness rule keeps or drops it."""

    def __init__(self, queue, trainer):
        self.queue, self.trainer, self.taken = queue, trainer, []

    def get(self, *args, **kwargs):
        sample = self.queue.get(*args, **kwargs)
        self.taken.append((int(sample.model_version), int(self.trainer.model_version)))
        return sample

    def __getattr__(self, name):
        return getattr(self.queue, name)


@functools.cache
def _async_trainer_class():
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    class DeltaSyncAsyncGRPOTrainer(AsyncGRPOTrainer):
        """AsyncGRPOTrainer with deltasync as its weight path and a server following the store
        (module docstring). deltasync_store: the store URL as the trainer sees it;
        deltasync_server_store: as the server sees it (default: the same); deltasync_options:
        DeltaPublisher options; follow_poll_seconds: how often the server asks the store;
        tree_attention: "sdpa" (sdpa_tree_attention, and no MFU metric), "fa3" (TRL's) or "auto"
        (sdpa without CUDA)."""

        def __init__(self, *args, deltasync_store, deltasync_server_store=None, deltasync_options=None,
                     follow_poll_seconds: float = 0.2, tree_attention: str = "auto", **kwargs):
            if tree_attention not in ("auto", "sdpa", "fa3"):
                raise ValueError(f"deltasync.trl.DeltaSyncAsyncGRPOTrainer: tree_attention={tree_attention!r}: "
                                 "use auto, sdpa or fa3")
            bound = inspect.signature(AsyncGRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
            if bound.get("weight_transfer") is not None or bound.get("rollout_worker") is not None:
                raise ValueError("deltasync.trl.DeltaSyncAsyncGRPOTrainer: it brings its own weight_transfer and "
                                 "rollout_worker")
            config = bound.get("args")
            if config is None:
                raise ValueError("deltasync.trl.DeltaSyncAsyncGRPOTrainer: give args=AsyncGRPOConfig("
                                 "vllm_server_base_url=...)")
            cpu_twins = tree_attention == "sdpa" or (tree_attention == "auto" and not torch.cuda.is_available())
            self.server = VLLMServerEngine(config.vllm_server_base_url,
                                           store=deltasync_server_store or deltasync_store)
            kwargs["weight_transfer"] = DeltaWeightTransfer(
                deltasync_store, follower=self.server, follow_poll_seconds=follow_poll_seconds,
                **{"anchor_every": 0, **(deltasync_options or {})})
            from .async_rollout import ServedVersionRolloutWorker

            with _building_trainer_with(ServedVersionRolloutWorker, cpu_twins):
                super().__init__(*args, **kwargs)
            self.consumed = None
            if self.rollout_queue is not None:
                self.consumed = self.rollout_queue = _ConsumedLog(self.rollout_queue, self)

        @property
        def reports(self) -> list[WeightSyncReport]:
            # Upload figures filled in once TRL's train() has ended (it destroys the transfer: close, flush).
            return self.weight_transfer.reports if self.weight_transfer is not None else []

    return DeltaSyncAsyncGRPOTrainer
