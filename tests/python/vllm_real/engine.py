"""Starting real vLLM engines on tiny checkpoints and reading what they serve."""
from __future__ import annotations

import gc
import os
from contextlib import contextmanager

import torch

PROMPTS = [list(range(3, 11)), [(7 * i) % 240 + 3 for i in range(300)]]  # the long one spans many KV blocks


@contextmanager
def engine(path, tp: int = 1, keep_cpu_weights: str = "1", **kwargs):
    """An LLM on the checkpoint folder `path`, shut down on exit. keep_cpu_weights: the test
    plugin's mode ("0": stock vLLM-CPU; see plugins/deltasync_test_keep_cpu_weights.py)."""
    from vllm import LLM

    old = os.environ.get("DELTASYNC_TEST_KEEP_CPU_WEIGHTS")
    os.environ["DELTASYNC_TEST_KEEP_CPU_WEIGHTS"] = keep_cpu_weights
    if tp > 1:
        # vLLM-CPU binds each rank to a NUMA node of its own unless told which cores to use;
        # this machine has one node: one core per rank (shared with the rest when fewer).
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(tp))
    stock_in_process = keep_cpu_weights != "1"
    try:
        llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
                  enable_prefix_caching=True, enforce_eager=True, max_num_seqs=4, seed=0,
                  tensor_parallel_size=tp,
                  # Stock engines in worker processes: the test plugin is loaded there with the
                  # setting above, while this process keeps the one it loaded first.
                  distributed_executor_backend="mp" if (tp > 1 or stock_in_process) else "uni", **kwargs)
    finally:
        os.environ["DELTASYNC_TEST_KEEP_CPU_WEIGHTS"] = old or "1"
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _worker_params(worker):
    model = worker.model_runner.get_model()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def runtime_params(llm) -> list[dict[str, torch.Tensor]]:
    """Every runtime parameter of every rank."""
    return llm.collective_rpc(_worker_params)


def generate(llm) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for PROMPTS (the same requests, in the same batch, on
    every engine: CPU kernels are deterministic for equal inputs)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=6, temperature=0.0, logprobs=1), use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


def assert_same_params(got: list[dict], want: list[dict], label: str) -> None:
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{label} rank {rank}: parameter names differ"
        for name in w:
            a, b = g[name], w[name]
            assert a.dtype == b.dtype and a.shape == b.shape, f"{label} rank {rank}: {name}"
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), \
                f"{label} rank {rank}: {name} differs from a fresh vLLM load"
