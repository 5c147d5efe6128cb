"""A process that ends while its follower's poll is in flight exits cleanly. The polling thread is
a daemon; caught inside the native poll (GIL released) when the interpreter finalizes, it is
ended by an unwind through C++ that cannot be unwound, and the process aborts ("terminate called
without an active exception"): the soak's vLLM follower did so once at its exit. The follower
module stops its followers at exit instead, the poll in flight finishing first: no polling thread
is left when the interpreter's exit handlers are done (the moment it starts ending threads),
whenever the poll would have returned."""
from __future__ import annotations

import http.server
import socketserver
import subprocess
import sys
import threading
import time

CHILD = r"""
import atexit, sys, threading, time


def polling_threads_left():  # registered first, so it runs after the follower module's own exit handler
    left = [t.name for t in threading.enumerate() if t.name == "deltasync-follow" and t.is_alive()]
    print(f"polling threads left after atexit: {left}", flush=True)


atexit.register(polling_threads_left)
from deltasync.vllm.follow import FollowOptions, StoreFollower

follower = StoreFollower(object(), FollowOptions(sys.argv[1], poll_seconds=0.05))
deadline = time.monotonic() + 30
while not open(sys.argv[2]).read() and time.monotonic() < deadline:  # until the store holds a poll
    time.sleep(0.01)
print("exiting with a poll in flight", flush=True)
"""

class StallingStore:
    """An HTTP store that holds every request `stall` seconds, then has nothing (404), and marks
    in a file that a request is being held."""

    def __init__(self, marker, stall: float):
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                marker.write_text("held")
                time.sleep(stall)
                store.answered += 1
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET

        self.answered = 0
        self.httpd = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/weights/run-1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_exit_with_a_poll_in_flight_is_clean(tmp_path):
    marker = tmp_path / "held"
    marker.write_text("")
    store = StallingStore(marker, stall=2.0)
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, store.url, str(marker)], capture_output=True, text=True,
                              timeout=120)
    finally:
        store.close()
    out = done.stdout + done.stderr
    assert "exiting with a poll in flight" in out, out
    assert done.returncode == 0, f"exit status {done.returncode}:\n{out}"
    assert "polling threads left after atexit: []" in out, out  # ended before the interpreter finalizes
    assert "terminate called" not in out, out
    assert store.answered >= 1  # the held poll was answered before the process ended
