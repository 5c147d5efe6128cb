"""The soak's Python subscriber: a DeltaSubscriber on zeroed tensors of the soak model's shapes,
following the store with random lags until it holds --versions. After every update it reports
the version and the SHA-256 of its weights (the orchestrator compares it with the trainer's)."""
from __future__ import annotations

import random
import sys
import time

import torch

import deltasync

import soak_model


def main() -> int:
    ap = soak_model.soak_arguments()
    ap.add_argument("--max-lag", type=float, default=0.5, help="seconds slept between updates: uniform in [0, this]")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tensors = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in soak_model.shapes()}
    sub = deltasync.DeltaSubscriber(tensors, store=args.store)
    soak_model.emit(event="started")
    while True:
        time.sleep(rng.uniform(0, args.max_lag))
        try:
            if sub.poll() is None:
                continue
            version = sub.update()
        except deltasync.errors.DeltaSyncError as e:
            soak_model.emit(event="error", error=str(e).splitlines()[0])
            continue
        report = sub.last_report
        soak_model.emit(event="synced", version=version, sha=soak_model.sha256_of(tensors),
             recovered=bool(getattr(report, "recovered", False)))
        if version >= args.versions:
            return 0


if __name__ == "__main__":
    sys.exit(main())
