"""The soak's proxy between every store client and the S3 server: it injects faults at random
(5xx, 429, cut connections, stalls, truncated bodies) and SIGKILLs the publisher at exact points
of its request stream (before its first upload of a version, before a multipart upload's second
part, before the manifest, before LATEST), counting all of it.

It forwards requests unchanged (Host included: SigV4 signs it), as tests/python/fault_proxy.py
does, whose forwarding, server and handler (partial bodies, dropped connections) it uses."""
from __future__ import annotations

import collections
import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/python: fault_proxy
from fault_proxy import QuietHandler, ThreadingServer, forward  # noqa: E402

FAULT_KINDS = ("5xx", "429", "cut", "stall", "truncated")
KILL_POINTS = ("before_upload", "mid_part", "before_manifest", "before_latest")
_VERSION = re.compile(r"/(?:deltas|anchors|manifests)/(\d{20})")


class _Server(ThreadingServer):
    def handle_error(self, request, client_address):
        # Clients drop connections on purpose here (a killed publisher, a stalled read given up).
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class SoakProxy:
    """rate: share of requests that get a fault; weights: relative weight per fault kind;
    kill_rates: probability per kill point that the publisher dies there; stall_seconds: how long
    a stalled response hangs before the connection is closed (the client's low-speed limit
    should give up sooner)."""

    def __init__(self, upstream: tuple[str, int], seed: int, rate: float, kill_rates: dict[str, float],
                 weights: dict[str, float] | None = None, stall_seconds: float = 2.5):
        self.upstream = upstream
        self.rng = random.Random(seed)
        self.rate = rate
        self.weights = weights or {"5xx": 3, "429": 2, "cut": 3, "stall": 1, "truncated": 2}
        self.kill_rates = kill_rates
        self.stall_seconds = stall_seconds
        self.lock = threading.Lock()
        self.faults = collections.Counter()
        self.kills = collections.Counter()
        self.kill_log: list[tuple[str, int | None, float]] = []  # (point, version, time)
        self.requests = 0
        self.committed: set[int] = set()  # versions whose manifest the server created
        self.commit_time: dict[int, float] = {}  # version -> time.monotonic() of its manifest's creation
        self.publisher_pid: int | None = None  # set by the orchestrator once the publisher has resumed
        self._uploading: set[int] = set()      # versions whose first object was seen
        self.enabled = True
        proxy = self

        class Handler(QuietHandler):
            def _handle(self):
                body = self.read_body()
                if proxy._maybe_kill(self.command, self.path, body):
                    self.drop_connection()  # the publisher is gone; nothing is forwarded
                    return
                kind = proxy._pick_fault()
                if kind in ("5xx", "429"):
                    status, code = (429, "TooManyRequests") if kind == "429" else proxy.rng.choice(
                        [(503, "SlowDown"), (500, "InternalError")])
                    xml = (f'<?xml version="1.0"?><Error><Code>{code}</Code>'
                           f"<Message>injected by the soak proxy</Message></Error>").encode()
                    self.send_all(status, [("Content-Type", "application/xml")], xml)
                    return
                if kind == "cut" and proxy.rng.random() < 0.5:
                    self.drop_connection()  # before forwarding: the server never saw it
                    return
                status, headers, data = forward(proxy.upstream, self.command, self.path, self.headers, body)
                proxy._note_commit(self.command, self.path, status)
                if kind == "cut" or (kind in ("stall", "truncated") and (self.command == "HEAD" or len(data) < 2)):
                    self.drop_connection()  # after forwarding: the server did it, the answer is lost
                    return
                if kind in ("stall", "truncated"):
                    self.send_all(status, headers, data, body_bytes=1 if kind == "stall" else len(data) // 2)
                    if kind == "stall":
                        time.sleep(proxy.stall_seconds)
                    self.drop_connection()
                    return
                self.send_all(status, headers, data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _note_commit(self, method: str, path: str, status: int) -> None:
        """A manifest the server created: that version became visible (even if the answer is lost)."""
        if method == "PUT" and status == 200 and "/manifests/" in path:
            m = _VERSION.search(path)
            if m:
                with self.lock:
                    self.committed.add(int(m.group(1)))
                    self.commit_time.setdefault(int(m.group(1)), time.monotonic())

    def _pick_fault(self) -> str | None:
        with self.lock:
            self.requests += 1
            if not self.enabled or self.rng.random() >= self.rate:
                return None
            kinds = list(self.weights)
            kind = self.rng.choices(kinds, [self.weights[k] for k in kinds])[0]
            self.faults[kind] += 1
            return kind

    def _kill_point(self, method: str, path: str, body: bytes) -> tuple[str, int | None] | None:
        """Which kill point this publisher request is (only writers PUT/POST)."""
        if method not in ("PUT", "POST"):
            return None
        key = path.split("?", 1)[0]
        m = _VERSION.search(key)
        version = int(m.group(1)) if m else None
        if key.endswith("/LATEST"):
            # "V\nrun R\nepoch E\nsince S\n": a publisher claiming the store at start-up writes
            # V == S (no version is made visible by it); a commit moves V past S.
            lines = body.decode(errors="replace").splitlines()
            if len(lines) == 4 and lines[0] == lines[3].removeprefix("since "):
                return None
            try:
                version = int(lines[0]) if lines else None
            except ValueError:
                version = None
            return "before_latest", version
        if "/manifests/" in key:
            return "before_manifest", version
        if "partNumber=2&" in path or path.endswith("partNumber=2"):
            return "mid_part", version
        if version is not None and version not in self._uploading and ("/deltas/" in key or "/anchors/" in key):
            self._uploading.add(version)
            return "before_upload", version
        return None

    def _maybe_kill(self, method: str, path: str, body: bytes) -> bool:
        with self.lock:
            if self.publisher_pid is None:
                return False
            point = self._kill_point(method, path, body)
            if point is None or self.rng.random() >= self.kill_rates.get(point[0], 0.0):
                return False
            pid, self.publisher_pid = self.publisher_pid, None  # one kill per incarnation
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return False
            self.kills[point[0]] += 1
            self.kill_log.append((point[0], point[1], time.time()))
            self._uploading.clear()  # the next incarnation uploads every version afresh
            return True

    def start(self) -> "SoakProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
