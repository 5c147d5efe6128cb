"""GRPOTrainer's `use_vllm=True, vllm_mode="server"` on deltasync: generation goes through a
stock `vllm serve` process (its OpenAI route /v1/completions, token IDs in and out), and every
weight sync publishes the step's delta to the store and tells the server, through vLLM's
weight-transfer routes, to bring itself to that version. No NCCL communicator is created and no
tensor crosses HTTP; the trainer's environment needs nothing of vLLM's.

    # server (instead of `trl vllm-serve --model MODEL`):
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}'
    # trainer (instead of GRPOTrainer(...)):
    from deltasync.trl import DeltaSyncGRPOTrainer
    trainer = DeltaSyncGRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="server",
                                   vllm_server_base_url="http://host:8000", ...), ...,
                                   deltasync_store="s3://bucket/run")

TRL builds its generation backend (trl.generation.vllm_generation.VLLMGeneration) inside
GRPOTrainer.__init__; the subclass has it build DeltaSyncVLLMGeneration instead, which keeps
TRL's parameter iteration (names as vLLM expects them, DDP/ZeRO-3 gathers) and its generate()
and replaces the two places that talk to `trl vllm-serve`: the communicator set-up and
sync_weights(). Version N is the weights after optimizer step N, published when TRL syncs (before
the generation that follows the step); every generation call is tagged with the version the
server served for it (`rollouts`)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass

from .sync import DeltaSync, SyncReport
from .vllm_server import VLLMServerEngine, VLLMServerError


@dataclass
class RolloutTag:
    """One generation call through the server: which version generated it."""

    version: int | None  # the version the server served for the whole call (None: it changed during the call)
    prompts: int
    completions: int
    trainer_step: int  # the trainer's optimizer step when it asked


class CompletionsClient:
    """The part of TRL's VLLMClient that GRPOTrainer's server mode uses for generation
    (generate, get_server_info), over stock vLLM's OpenAI routes: POST /v1/completions with token
    ID prompts and return_token_ids, so nothing is re-tokenized on either side."""

    def __init__(self, engine: VLLMServerEngine, trainer_step=lambda: -1):
        self.engine = engine
        self.trainer_step = trainer_step  # what each RolloutTag names as the trainer's step
        self.model = self.engine.get("/v1/models")["data"][0]["id"]
        self.requests = 0  # /v1/completions calls answered
        self.rollouts: list[RolloutTag] = []

    def get_server_info(self) -> dict:
        """What GRPOTrainer reads of `trl vllm-serve`'s /get_server_info (the logprobs mode), from
        vLLM's dev route /server_info."""
        config = self.engine.get("/server_info?config_format=json")["vllm_config"]
        return {"model_config": {"logprobs_mode": config["model_config"]["logprobs_mode"]}}

    def generate(self, prompts: list[list[int]], features=None, n: int = 1, repetition_penalty: float = 1.0,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 max_tokens: int = 16, logprobs: int | None = 0, structured_outputs_regex: str | None = None,
                 generation_kwargs: dict | None = None) -> dict:
        """`n` completions per prompt, in prompt order; the same dict as VLLMClient.generate."""
        if features is not None:
            raise ValueError("deltasync.trl.CompletionsClient: image prompts are not supported through /v1/completions")
        if structured_outputs_regex is not None:
            raise ValueError("deltasync.trl.CompletionsClient: vllm_structured_outputs_regex is not supported "
                             "through /v1/completions; pass it in generation_kwargs as structured_outputs")
        body = {"model": self.model, "prompt": [list(map(int, p)) for p in prompts], "n": n,
                "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                "repetition_penalty": repetition_penalty, "max_tokens": max_tokens, "return_token_ids": True,
                **(generation_kwargs or {})}
        if logprobs is not None:
            body["logprobs"] = logprobs
        before = self.engine.weight_version()
        response = self.engine.post("/v1/completions", body)
        after = self.engine.weight_version()
        self.requests += 1
        choices = sorted(response["choices"], key=lambda c: c["index"])
        if len(choices) != n * len(prompts):
            raise VLLMServerError(f"deltasync.trl.CompletionsClient: {len(prompts)} prompts x n={n} asked, "
                                  f"{len(choices)} completions answered")
        self.rollouts.append(RolloutTag(version=before if before == after else None, prompts=len(prompts),
                                        completions=len(choices), trainer_step=self.trainer_step()))
        out = {"prompt_ids": [list(map(int, p)) for p in prompts],
               "completion_ids": [c["token_ids"] for c in choices], "logprobs": None}
        if logprobs is not None:
            # [sequence][token][1]: the sampled token's logprob (TRL keeps the top-1 entry).
            out["logprobs"] = [[[lp] for lp in c["logprobs"]["token_logprobs"]] for c in choices]
        return out


@functools.cache
def _vllm_generation_class():
    from trl.generation.vllm_generation import VLLMGeneration

    class DeltaSyncVLLMGeneration(VLLMGeneration):
        """TRL's VLLMGeneration in server mode with deltasync as the weight path (module docstring)."""

        def __init__(self, *args, deltasync_store, deltasync_server_store=None, trainer_step=None,
                     deltasync_options=None, **kwargs):
            self._deltasync = (deltasync_store, deltasync_server_store or deltasync_store, deltasync_options or {})
            self._trainer_step = trainer_step or (lambda: -1)
            self.sync: DeltaSync | None = None
            self.sync_seconds: list[float] = []  # the trainer's wall time in each sync_weights(), as reports
            super().__init__(*args, **kwargs)

        def _init_vllm(self):
            # Replaces TRL's: no VLLMClient and no init_communicator (NCCL); vLLM need not be
            # importable here.
            if self.mode != "server":
                raise ValueError(f"deltasync.trl.DeltaSyncGRPOTrainer: vllm_mode={self.mode!r}; deltasync drives a "
                                 "vLLM server (vllm_mode='server')")
            if not self.accelerator.is_main_process:
                return
            store, server_store, options = self._deltasync
            url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            engine = VLLMServerEngine(url, store=server_store)
            _wait_for_server(engine, self.server_timeout)
            self.vllm_client = CompletionsClient(engine, self._trainer_step)
            # No anchor every N versions unless asked: the first version anchors, later ones under the size rule.
            self.sync = DeltaSync(store, engine=engine, **{"anchor_every": 0, **options})

        @property
        def reports(self) -> list[SyncReport]:
            return self.sync.reports if self.sync is not None else []

        @property
        def rollouts(self) -> list[RolloutTag]:
            return self.vllm_client.rollouts if self.accelerator.is_main_process else []

        def sync_weights(self):
            if self._dist.is_fsdp:
                raise ValueError("deltasync.trl.DeltaSyncGRPOTrainer: FSDP-sharded parameters are not supported "
                                 "(the publisher diffs whole tensors it keeps between steps)")
            from accelerate.utils import is_peft_model

            if is_peft_model(self.model):
                # TRL merges the adapters only while it walks the parameters; the publisher diffs
                # the tensors it was given after the walk, by then unmerged again.
                raise ValueError("deltasync.trl.DeltaSyncGRPOTrainer: PEFT models are not supported (TRL merges the "
                                 "adapters only during its parameter walk)")
            pairs = self._iter_named_params()
            if self.accelerator.is_main_process:
                started = time.perf_counter()
                # Waits until the version is visible in the store, then pauses the server for the
                # update only (the deltasync plugin resets its prefix cache after each update).
                self.sync.publish(list(pairs), version=self._trainer_step())
                self.sync_seconds.append(time.perf_counter() - started)
            else:
                for _ in pairs:  # take part in the gather collectives
                    pass

    return DeltaSyncVLLMGeneration


def _wait_for_server(engine: VLLMServerEngine, seconds: float) -> None:
    """Until the server answers /health (it may still be loading), as VLLMClient waits."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            engine.get("/health")
            return
        except VLLMServerError:
            if time.monotonic() > deadline:
                raise VLLMServerError(f"deltasync.trl.DeltaSyncGRPOTrainer: the vLLM server at {engine.url} did not "
                                      f"answer /health within {seconds:.0f} s") from None
            time.sleep(1)


@contextlib.contextmanager
def _building_generation_with(factory):
    """GRPOTrainer.__init__ builds `VLLMGeneration(...)` by its module's name: swapped for its time."""
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = original


@functools.cache
def _grpo_trainer_class():
    from trl import GRPOTrainer

    class DeltaSyncGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose vLLM server mode syncs through deltasync (module docstring).

        deltasync_store: the store URL as the trainer sees it; deltasync_server_store: as the
        server sees it (default: the same); deltasync_options: DeltaPublisher options."""

        def __init__(self, *args, deltasync_store, deltasync_server_store=None, deltasync_options=None, **kwargs):
            args_ = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments.get("args")
            if args_ is None or not args_.use_vllm or args_.vllm_mode != "server":
                raise ValueError("deltasync.trl.DeltaSyncGRPOTrainer: give args=GRPOConfig(use_vllm=True, "
                                 "vllm_mode='server', vllm_server_base_url=...)")
            generation = _vllm_generation_class()

            def factory(**generation_kwargs):
                return generation(deltasync_store=deltasync_store, deltasync_server_store=deltasync_server_store,
                                  deltasync_options=deltasync_options,
                                  trainer_step=lambda: self.state.global_step, **generation_kwargs)

            with _building_generation_with(factory):
                super().__init__(*args, **kwargs)

        def train(self, *args, **kwargs):
            try:
                return super().train(*args, **kwargs)
            finally:
                if self.vllm_generation.sync is not None:
                    self.vllm_generation.sync.flush()  # the reports' upload figures filled in

    return DeltaSyncGRPOTrainer
