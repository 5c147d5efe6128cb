"""The soak's trainer and publisher process. Every start resumes from the store alone
(DeltaPublisher(resume=True): the newest visible version's weights are pulled into the model and
become the shadow), then trains and publishes up to --versions. The proxy SIGKILLs it at chosen
points of a publish; the orchestrator starts it again. One JSON line per event on stdout."""
from __future__ import annotations

import random
import sys
import time

import deltasync

import soak_model


def main() -> int:
    ap = soak_model.soak_arguments()
    ap.add_argument("--anchor-every", type=int, default=20)
    ap.add_argument("--keep-anchors", type=int, default=3)
    ap.add_argument("--anchor-part-bytes", type=int, default=128 << 10)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--flush-share", type=float, default=0.7,
                    help="share of versions waited for until visible; the others overlap the next step (and merge when behind)")
    args = ap.parse_args()
    rng = random.Random(args.seed * 7919 + args.incarnation)

    trainer = soak_model.Trainer(args.seed)
    pub = deltasync.DeltaPublisher(trainer.tensors, store=args.store, anchor_every=args.anchor_every,
                                   keep_anchors=args.keep_anchors, anchor_part_bytes=args.anchor_part_bytes,
                                   resume=True)
    resumed = pub.resumed_version
    if resumed is not None:
        trainer.version = resumed  # the weights are the store's version `resumed`, written in by resume
    soak_model.emit(event="resumed", version=resumed, sha=trainer.sha256())
    start = 0 if resumed is None else resumed + 1
    failures = 0
    for v in range(start, args.versions + 1):
        if v > 0:
            trainer.step()
        try:
            pub.publish(v)
        except deltasync.errors.DeltaSyncError as e:  # an earlier upload's failure, reported once; v is staged
            failures += 1
            soak_model.emit(event="store_error", version=v, error=str(e).splitlines()[0])
        # Mostly wait until visible; sometimes let the next step overlap the upload (merging).
        if v == args.versions or rng.random() < args.flush_share:
            while True:
                try:
                    pub.flush()
                    break
                except deltasync.errors.DeltaSyncError as e:  # retried by the next flush
                    failures += 1
                    soak_model.emit(event="store_error", version=v, error=str(e).splitlines()[0])
                    if failures > 1000:
                        raise
                    time.sleep(0.05)
            soak_model.emit(event="visible", version=pub.state()["last_version"])
    pub.close()
    soak_model.emit(event="done", version=args.versions, failures=failures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
