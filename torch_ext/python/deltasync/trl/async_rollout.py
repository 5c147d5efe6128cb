"""The rollout worker of DeltaSyncAsyncGRPOTrainer (async_grpo.py): TRL's AsyncRolloutWorker,
generating through vLLM's token route /inference/v1/generate (`vllm serve --enable-scale-out`)
and tagging every rollout group with the oldest version that sampled any of its tokens (each
choice's `weight_versions` spans). Its loop runs in a spawned child process, which unpickles the
class by its module's name: hence this module, importing TRL at its top."""
from __future__ import annotations

import contextvars
import random

from trl.experimental.async_grpo import async_rollout_worker as worker_module

# The group a rollout task generates for: set in each task's own context (asyncio copies it).
_group = contextvars.ContextVar("deltasync_rollout_group", default=None)


def served_version(spans: list[dict] | None) -> int | None:
    """The oldest version among a choice's `weight_versions` spans; None without spans (no token),
    or when a span is not a deltasync version (vLLM's "default": the weights it loaded itself)."""
    versions = [s["version"] for s in spans or [] if s["end"] > s["start"]]
    if not versions or not all(isinstance(v, str) and v.isdigit() for v in versions):
        return None
    return min(int(v) for v in versions)


class ServedVersionRolloutLoop(worker_module._AsyncRolloutLoop):
    """TRL's rollout loop generating through /inference/v1/generate and tagging every group
    with the oldest served version that sampled any of its tokens (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._served: dict[int, list[int | None]] = {}

    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
        _group.set(group_id)  # this task's context only
        return await super()._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)

    async def _generate_one_turn(self, prompt_ids):
        sampling = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k, "repetition_penalty": self.repetition_penalty, "n": 1,
                    "logprobs": 0, "seed": random.getrandbits(63)}  # as TRL: independent samples
        if self.min_p is not None:
            sampling["min_p"] = self.min_p
        payload = {"model": self._request_model, "token_ids": list(prompt_ids), "sampling_params": sampling}
        output = await self._retry(lambda: self._post("/inference/v1/generate", payload, self.request_timeout),
                                   max_attempts=30, label="vllm /inference/v1/generate")
        choice = output["choices"][0]
        self._served.setdefault(_group.get(), []).append(served_version(choice.get("weight_versions")))
        return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]

    async def _score_group(self, group):
        versions = self._served.pop(group.group_id, [])
        if not versions or None in versions:
            raise RuntimeError(f"deltasync.trl: rollout group {group.group_id}: a completion carries no deltasync "
                               f"version ({versions}); is the server following the store?")
        group.model_version = min(versions)
        return await super()._score_group(group)


class ServedVersionRolloutWorker(worker_module.AsyncRolloutWorker):
    _loop_cls = ServedVersionRolloutLoop
