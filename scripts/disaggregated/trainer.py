"""The trainer process of the disaggregated demo (runs in .venv: TRL, transformers, deltasync;
no vLLM): GRPO on the toy task, every optimizer step published to the store by
deltasync.trl.DeltaSyncCallback, which then has the vLLM server (another process, another
environment) update itself from the store through its HTTP routes. One line per step; at the
end, the served weights are audited against the trainer's.

    python trainer.py --store URL --server http://127.0.0.1:PORT --base DIR --work DIR --steps N
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

import server_process
import toy_task
from deltasync import ops
from deltasync.trl import DeltaSyncCallback, VLLMServerEngine


def kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


class StepLines(TrainerCallback):
    """Prints one line per version once its reward is logged (on_log follows on_step_end)."""

    def __init__(self, sync: DeltaSyncCallback):
        self.sync = sync
        self.printed = -1

    def line(self, report, reward: float | None) -> str:
        share = report.changed_elements / report.total_elements
        kind = "anchor" if report.anchor else "delta "
        reward_text = "  -   " if reward is None else f"{reward:.3f}"
        written = report.delta_bytes + report.anchor_bytes
        return (f"step {report.version:2d}  reward {reward_text}  changed {report.changed_elements:7,d}/"
                f"{report.total_elements:,d} ({share:6.2%})  {kind} {kib(written):>10} vs full "
                f"{kib(report.model_bytes)} ({written / report.model_bytes:6.1%})  "
                f"publish {report.publish_seconds * 1e3:6.1f} ms  pause {report.pause_seconds * 1e3:6.1f} ms  "
                f"served v{report.served_version}")

    def on_train_begin(self, args, state, control, **kwargs):
        # Version 0 (the anchor of the starting weights) was synced by DeltaSyncCallback's on_train_begin.
        self.sync.sync.flush()
        print(self.line(self.sync.reports[0], None), flush=True)
        self.printed = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs and state.global_step > self.printed:
            self.sync.sync.flush()  # fills delta_bytes (visible already: the engine waited for it)
            print(self.line(self.sync.reports[state.global_step], logs["reward"]), flush=True)
            self.printed = state.global_step


def audit(engine: VLLMServerEngine, model, work: Path, published: int) -> bool:
    """The served weights against the trainer's: digests per tensor, and every runtime element
    through vLLM's own loader (deltasync.vllm.audit)."""
    params = dict(model.named_parameters())
    digests = ops.digest([p.detach() for p in params.values()]).tolist()
    final = work / "trainer-final"  # written for the audit only: the loop itself moves weights through the store
    model.save_pretrained(final, safe_serialization=True)
    result = engine.collective_rpc("deltasync_audit", json.dumps(dict(zip(params, map(str, digests)))),
                                   str(final))[0]
    ok = (result["version"] == published and not result["digests_differ"]
          and not result["missing_on_server"] and result["loader_error"] is None)
    print(f"check: the server's weights are at v{result['version']}, the trainer's last version is v{published}; "
          f"{result['digests_compared']}/{len(params)} tensors' digests equal the trainer's"
          + (f" (differ: {result['digests_differ'][:3]})" if result["digests_differ"] else "")
          + (f", not served: {result['not_served']}" if result["not_served"] else ""))
    print(f"check: vLLM's loader on the trainer's final tensors: "
          + (f"{result['loader_elements']:,d} runtime elements equal the served ones bit for bit"
             if result["loader_error"] is None else f"MISMATCH: {result['loader_error']}"))
    print("check: served weights == trainer's, bit for bit" if ok else "check: FAILED")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True, help="the store URL as the trainer sees it")
    ap.add_argument("--server-store", help="the store URL as the server sees it (default: --store)")
    ap.add_argument("--server", required=True)
    ap.add_argument("--base", required=True, help="the base checkpoint both sides start from")
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=toy_task.LEARNING_RATE)
    args = ap.parse_args()
    work = Path(args.work)

    import trl  # after argparse: its import takes seconds

    tokenizer = toy_task.load_tokenizer(args.base)
    model = toy_task.load_model(args.base)
    engine = VLLMServerEngine(args.server, store=args.server_store or args.store)
    # No anchor every N versions: version 0 anchors, and a later one only under the size rule
    # (the deltas since the last anchor add up to more than anchor_share of the model).
    sync = DeltaSyncCallback(args.store, engine=engine, anchor_every=0)
    config = trl.GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=8, num_generations=8,
                            max_completion_length=8, max_steps=args.steps, learning_rate=args.lr,
                            logging_steps=1, report_to="none", save_strategy="no", use_vllm=False, use_cpu=True,
                            seed=0, dataloader_num_workers=0, beta=0.0, disable_tqdm=True, log_level="error")
    trainer = trl.GRPOTrainer(model=model, args=config, processing_class=tokenizer,
                              reward_funcs=toy_task.reward, train_dataset=toy_task.prompts(),
                              callbacks=[sync, StepLines(sync)])
    # The trainer's logs (one dict per step) would interleave with the lines; the lines carry the reward.
    trainer.remove_callback(PrinterCallback)
    server_process.wait_healthy(args.server, 600)
    import transformers

    with urllib.request.urlopen(args.server + "/version", timeout=10) as r:
        served_by = json.loads(r.read()).get("version")
    print(f"versions: TRL {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__} "
          f"(trainer); vLLM {served_by} (server)", flush=True)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    reports = sync.reports
    deltas = reports[1:]
    print(f"{len(deltas)} steps in {seconds:.1f} s; deltas {kib(sum(r.delta_bytes for r in deltas))} in all vs "
          f"{kib(len(deltas) * reports[0].model_bytes)} of full copies; median publish "
          f"{sorted(r.publish_seconds for r in deltas)[len(deltas) // 2] * 1e3:.1f} ms, median pause "
          f"{sorted(r.pause_seconds for r in deltas)[len(deltas) // 2] * 1e3:.1f} ms")
    return 0 if audit(engine, model, work, reports[-1].version) else 1


if __name__ == "__main__":
    sys.exit(main())
