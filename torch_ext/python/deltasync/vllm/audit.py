"""An end-to-end check of what a vLLM server serves against what the trainer holds, for engines
that follow a store through the native "deltasync" weight-transfer backend. Mixed into every
worker with

    vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}' \
        --worker-extension-cls deltasync.vllm.audit.ServedWeightsAudit

and called through POST /collective_rpc {"method": "deltasync_audit", "args": [DIGESTS, CHECKPOINT]}
(vLLM passes string arguments only). Two checks, neither trusting the path the weights took:

1. digests: every Hugging Face tensor, gathered back out of the fused runtime parameters
   through the learned index map, hashed with deltasync.ops.digest and compared with the
   trainer's digest of the same tensor (a few integers cross the wire);
2. loader (when CHECKPOINT names a folder of the trainer's tensors as safetensors): vLLM's own
   loader puts them into copies of the runtime parameters, and every copy must equal the
   served parameter bit for bit (the comparison that refuses engines which re-lay out weights).
"""
from __future__ import annotations

import glob
import json
import os

import torch

from .. import ops
from .extension import worker_model
from .updatable import NotUpdatableError, check_served_weights


def gather(imap, name: str) -> torch.Tensor | None:
    """The HF tensor `name` (flat) as this worker's runtime parameters hold it; None where no
    parameter here holds it (a tied lm_head, another rank's shard)."""
    dtype, shape = imap.hf_tensors[name]
    runs = imap.targets.get(name) or []
    if not runs:
        return None
    out = torch.empty(torch.Size(shape).numel(), dtype=dtype)
    held = 0
    for target in runs:
        flat = imap.params[target.param_index].reshape(-1)
        for hf, n, rt in zip(target.hf_start.tolist(), target.length.tolist(), target.rt_start.tolist()):
            out[hf:hf + n] = flat[rt:rt + n]
            held += n
    return out if held == out.numel() else None  # a shard: its digest is not the whole tensor's


class ServedWeightsAudit:
    """Mixed into vLLM's worker class; `self` is the worker. One rank of TP=1 (at TP > 1 each
    rank holds shards, which digests of whole tensors do not cover: see `not_served`)."""

    def deltasync_audit(self, trainer_digests_json: str, checkpoint_dir: str = "") -> dict:
        """trainer_digests_json: {HF name: deltasync.ops.digest value, as a decimal string}."""
        engine = getattr(self, "weight_transfer_engine", None)
        sub = getattr(engine, "subscriber", None)
        if sub is None or sub.index_map is None:
            raise RuntimeError("deltasync.vllm.audit: the deltasync weight-transfer backend is not connected "
                               "(POST /init_weight_transfer_engine first)")
        imap = sub.index_map
        want = {name: int(d) for name, d in json.loads(trainer_digests_json).items()}
        differ, not_served, compared = [], [], 0
        for name in imap.hf_tensors:
            served = gather(imap, name)
            if served is None:
                not_served.append(name)
                continue
            compared += 1
            if name not in want or int(ops.digest([served])[0]) != want[name]:
                differ.append(name)
        result = {"version": sub.version, "digests_compared": compared, "digests_differ": differ,
                  "not_served": not_served, "missing_on_server": sorted(set(want) - set(imap.hf_tensors)),
                  "loader_elements": None, "loader_error": None}
        if checkpoint_dir:
            files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
            if not files:
                result["loader_error"] = f"{checkpoint_dir}: no *.safetensors files"
            else:
                try:
                    result["loader_elements"] = check_served_weights(worker_model(self), files)
                except NotUpdatableError as e:  # its message is about engines that re-lay out weights
                    result["loader_error"] = (f"runtime tensor {e.tensor} differs from what vLLM's loader makes of "
                                              f"the tensors in {checkpoint_dir}")
        return result
