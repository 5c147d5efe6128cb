"""The asynchronous GRPO loop on Qwen3-0.6B's shape, on this CPU: TRL 1.16's AsyncGRPOTrainer
(deltasync.trl.DeltaSyncAsyncGRPOTrainer, AdamW, an RL learning rate) training a random-init
model of that shape (596M bf16 elements, 310 tensors; transformers' Qwen3 config with Qwen3-0.6B's
dimensions, its own random init, nothing downloaded) against a vLLM-CPU server started from the
vLLM environment that follows the store on its own time. Random-init weights are not trained
weights: how many elements an optimizer step moves depends on the weights' magnitudes. The reward
is toy_task.token_parity_reward (the share of even token IDs), which a random model varies on.

    DELTASYNC_VLLM_PYTHON=... DELTASYNC_VLLM_SITE=... python benchmarks/qwen3_loop.py --steps 6

Per version: the share of elements changed, the delta's bytes against the full weights, the
trainer's time in each of its weight syncs (TRL's own span, AsyncGRPOTrainer._sync_weight, timed
call by call: TRL's perf/weight_sync_s metric is a mean over its logging window, and the first
window holds the cold sync too) against the delta's staging inside it
(PublishStats.stage_seconds), the server's pause for the update (its follower's log: the engine
schedules no step while it updates), and the versions that generated the samples each optimizer
step took (lag = trainer version - served version). Versions published as anchors (every
--anchor-every) carry the full weights through the same path. Prints Markdown.

The optimizer is what an RL run uses: AdamW (optim="adamw_torch", betas 0.9/0.999, eps 1e-8, no weight
decay), a constant learning rate (--lr, default 1e-6), gradients clipped to norm 1 (TRL's
defaults besides the learning rate)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
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


def make_checkpoint(folder: Path, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = toy_task.make_chat_tokenizer()  # its IDs are a subset of the model's vocabulary
    torch.manual_seed(0)
    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": layers}, max_position_embeddings=512,
                         torch_dtype="bfloat16", pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
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
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"],
                        help="decoder layers (fewer: a smaller model of the same widths, for a quick look)")
    args = parser.parse_args()
    python, site = os.environ["DELTASYNC_VLLM_PYTHON"], os.environ["DELTASYNC_VLLM_SITE"]
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import deltasync.publisher as publisher_module
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from deltasync.trl import DeltaSyncAsyncGRPOTrainer

    staged = {}  # version -> stage_seconds, as publish() returned it
    original_publish = publisher_module.DeltaPublisher.publish

    def recording_publish(self, version, anchor=None):
        stats = original_publish(self, version, anchor)
        staged[int(version)] = stats.stage_seconds
        return stats

    synced = []  # the trainer's seconds in each _sync_weight() call: [0] the cold sync (version 1), [i] version i + 1
    original_sync = AsyncGRPOTrainer._sync_weight
    started = time.perf_counter()

    def timed_sync(self):
        t = time.perf_counter()
        original_sync(self)
        synced.append(time.perf_counter() - t)
        print(f"[{time.perf_counter() - started:6.0f} s] version {len(synced)} published, trainer in sync "
              f"{synced[-1]:.2f} s, staging {staged.get(len(synced), float('nan')):.2f} s", file=sys.stderr, flush=True)

    publisher_module.DeltaPublisher.publish = recording_publish
    AsyncGRPOTrainer._sync_weight = timed_sync
    with tempfile.TemporaryDirectory(prefix="qwen3-loop-") as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        make_checkpoint(base, args.layers)
        log = tmp / "server.log"
        logging_config = tmp / "server-logging.json"
        logging_config.write_text(json.dumps(SERVER_LOGGING))
        with server_process.running(python, base, log, healthy_within=900, site=site,
                                    env={"VLLM_LOGGING_CONFIG_PATH": str(logging_config)},
                                    extra_args=("--enable-scale-out",)) as (url, _):
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
            train_started = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - train_started
            # The server follows to the last version on its own time: wait for it, so its pause is in the log.
            deadline = time.monotonic() + 300
            while trainer.server.weight_version() != trainer.reports[-1].version and time.monotonic() < deadline:
                time.sleep(0.5)
            report(trainer, staged, synced, server_pauses(log.read_text()), wall, args)


# vLLM's own logging plus deltasync's follower (deltasync.vllm.follow logs each update it makes) on the server's output.
SERVER_LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                "deltasync": {"handlers": ["out"], "level": "INFO", "propagate": False}},
}
FOLLOWER_UPDATE = re.compile(r"deltasync: following \S+: serving version (\d+) \(([\d.]+) ms")


def server_pauses(server_log: str) -> dict[int, float]:
    """version -> seconds the server spent updating to it (no engine step meanwhile), from its follower's log."""
    return {int(v): float(ms) / 1e3 for v, ms in FOLLOWER_UPDATE.findall(server_log)}


def report(trainer, staged, synced, pauses, wall, args) -> None:
    reports = trainer.reports
    model_bytes = reports[0].model_bytes
    shape = "Qwen3-0.6B shape" if args.layers == QWEN3_0_6B["num_hidden_layers"] else \
        f"Qwen3-0.6B widths with {args.layers} layers"
    print(f"## {shape}, random init, AsyncGRPO on CPU ({args.steps} steps, AdamW lr {args.lr:g}, "
          f"anchor every {args.anchor_every}, max_staleness {args.max_staleness})\n")
    print(f"{reports[0].total_elements / 1e6:.0f}M elements, {len(trainer.weight_transfer.sync._held)} tensors, "
          f"{model_bytes / 1e6:.0f} MB bf16; wall time of train(): {wall:.0f} s\n")
    print("| version | anchor | changed | payload MB | payload / full | payload / seed's 20-35 MB | trainer sync s | "
          "staging s | sync / staging | server pause s | samples' served versions (lag) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    # Samples the optimizer step after version v's sync took (trainer version v when taken), by served version.
    taken = collections.defaultdict(collections.Counter)
    for served, trainer_version in trainer.consumed.taken:
        taken[trainer_version][served] += 1
    for r in trainer.reports:
        sync = synced[r.version - 1] if r.version - 1 < len(synced) else None
        stage = staged.get(r.version)
        pause = pauses.get(r.version)
        ratio = f"{sync / stage:.2f}" if sync and stage else "-"
        served = ", ".join(f"{v} ({r.version - v}): {n}" for v, n in sorted(taken.get(r.version, {}).items())) or "-"
        payload = r.delta_bytes + r.anchor_bytes  # its delta, plus the full weights of an anchor
        print(f"| {r.version} | {'yes' if r.anchor else ''} | {r.changed_elements / r.total_elements:.3%} | "
              f"{payload / 1e6:.2f} | {payload / model_bytes:.2%} | {payload / 35e6:.2f}-{payload / 20e6:.2f}x | "
              f"{'-' if sync is None else f'{sync:.3f}'} | {'-' if stage is None else f'{stage:.3f}'} | {ratio} | "
              f"{'-' if pause is None else f'{pause:.3f}'} | {served} |")
    print("\nVersion 1 is the cold sync at train begin: an anchor, and the one sync that waits, for its upload and "
          "for the server to follow and serve it, so that no rollout comes from unversioned weights.")
    print("\nVersion v's row lists the samples the optimizer step after its sync took (trainer version v), by the "
          "version that generated them (lag); TRL drops those with lag over max_staleness.")
    lags = collections.Counter(t - s for s, t in trainer.consumed.taken)
    print(f"\nRollout lag (trainer version - served version) of the {len(trainer.consumed.taken)} samples the trainer "
          "took: " + ", ".join(f"{k}: {v}" for k, v in sorted(lags.items())))
    if lags:
        print(f"mean lag {statistics.fmean(t - s for s, t in trainer.consumed.taken):.2f}")

if __name__ == "__main__":
    main()
