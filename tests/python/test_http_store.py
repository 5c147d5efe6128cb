"""The plain HTTP store (WebDAV-style PUT/GET/HEAD/DELETE) and the folder store through the CLI.
The HTTP server is a minimal in-memory one on 127.0.0.1 that honours If-None-Match (`*` on PUT,
an ETag on GET) like WebDAV servers do; it cannot list, so readers find versions through LATEST and
manifests by name."""
import hashlib
import http.server
import os
import socketserver
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from store_model import SyntheticModel, assert_identical  # noqa: E402


class DavServer:
    def __init__(self):
        self.objects = {}
        self.lock = threading.Lock()
        # When set, every request is refused with a body that echoes it, as many error pages do.
        self.deny_with_echo = False
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _reply(self, status, body=b"", headers=()):
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _denied(self):
                if not server.deny_with_echo:
                    return False
                echo = f"Cannot {self.command} {self.path} ({self.headers.get('Authorization')})".encode()
                self._reply(403, echo, [("Content-Type", "text/plain")])
                return True

            def do_PUT(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self._denied():
                    return
                with server.lock:
                    if self.headers.get("If-None-Match") == "*" and self.path in server.objects:
                        return self._reply(412)
                    server.objects[self.path] = body
                self._reply(201)

            def do_GET(self):
                if self._denied():
                    return
                with server.lock:
                    body = server.objects.get(self.path)
                if body is None:
                    return self._reply(404)
                etag = '"' + hashlib.md5(body).hexdigest() + '"'
                if self.headers.get("If-None-Match") == etag:
                    return self._reply(304, headers=[("ETag", etag)])
                rng = self.headers.get("Range")
                if rng:
                    first, last = rng.split("=")[1].split("-")
                    part = body[int(first):int(last) + 1]
                    return self._reply(206, part, [("ETag", etag), ("Content-Range", f"bytes {first}-{int(first) + len(part) - 1}/{len(body)}")])
                self._reply(200, body, [("ETag", etag)])

            do_HEAD = do_GET

            def do_DELETE(self):
                with server.lock:
                    server.objects.pop(self.path, None)
                self._reply(204)

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/weights/run-1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def dav():
    server = DavServer()
    yield server
    server.stop()


def publish_versions(run_cli, tmp_path, store, count, anchor_every=3):
    model, versions = SyntheticModel(3), {}
    ckpt = tmp_path / "ckpt.safetensors"
    for v in range(1, count + 1):
        if v > 1:
            model.step()
        model.save(ckpt)
        versions[v] = model.snapshot()
        run_cli("publish", ckpt, "--store", store, "--version", v, "--state", tmp_path / "state",
                "--anchor-every", anchor_every, "--quiet")
    return versions


def test_http_store_publish_and_pull_without_listing(run_cli, dav, tmp_path):
    versions = publish_versions(run_cli, tmp_path, dav.url, 7)
    assert any(k.startswith("/weights/run-1/manifests/") for k in dav.objects)
    follower = tmp_path / "follower.safetensors"
    run_cli("pull", "--store", dav.url, "-o", follower, "--version", 5)
    assert_identical(follower, versions[5], 5)
    out = run_cli("pull", "--store", dav.url, "-o", follower).stdout
    assert "version 5 -> 7 via 2 deltas" in out, out
    assert_identical(follower, versions[7], 7)
    late = tmp_path / "late.safetensors"
    out = run_cli("pull", "--store", dav.url, "-o", late).stdout
    assert "via anchor 7" in out, out  # anchors at 1, 4, 7
    result = run_cli("log", "--store", dav.url, check=False)
    assert result.returncode != 0 and "listing is not supported" in result.stderr


def test_http_store_manifest_is_created_once(run_cli, dav, tmp_path):
    publish_versions(run_cli, tmp_path, dav.url, 1)
    model = SyntheticModel(99)
    other = tmp_path / "other.safetensors"
    model.save(other)
    # Another publisher (no shared state) trying to publish version 1 again is refused.
    result = run_cli("publish", other, "--store", dav.url, "--version", 1, "--state", tmp_path / "other-state",
                     check=False)
    assert result.returncode != 0 and "already exists" in result.stderr, result.stderr


def test_folder_store_cli_round_trip_and_publish_without_state(run_cli, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    model, versions = SyntheticModel(5), {}
    ckpt = tmp_path / "ckpt.safetensors"
    for v in (1, 2, 3):
        if v > 1:
            model.step()
        model.save(ckpt)
        versions[v] = model.snapshot()
        # No --state: the publisher rebuilds its shadow from the store each time.
        run_cli("publish", ckpt, "--store", store, "--version", v * 10, "--quiet")
    out = tmp_path / "out.safetensors"
    run_cli("pull", "--store", store, "-o", out)
    assert_identical(out, versions[3], 30)
    log = run_cli("log", "--store", store).stdout
    assert "3 versions; LATEST -> 30" in log, log
    assert "anchor" in log.splitlines()[1] and "delta" in log.splitlines()[2]
    result = run_cli("publish", ckpt, "--store", store, "--version", 20, check=False)
    assert result.returncode != 0 and "not newer" in result.stderr


def test_folder_store_trl_layout_is_readable_by_safetensors(run_cli, tmp_path):
    safetensors = pytest.importorskip("safetensors")
    store_dir = tmp_path / "store"
    model, ckpt = SyntheticModel(8), tmp_path / "ckpt.safetensors"
    model.save(ckpt)
    run_cli("publish", ckpt, "--store", store_dir, "--version", 1, "--state", tmp_path / "state", "--format", "trl")
    model.step()
    model.save(ckpt)
    run_cli("publish", ckpt, "--store", store_dir, "--version", 2, "--state", tmp_path / "state", "--format", "trl")
    (delta,) = (store_dir / "deltas").iterdir()
    with safetensors.safe_open(str(delta), "np") as f:
        assert f.metadata()["sparse"] == "True" and f.metadata()["model_version"] == "2"
        assert "model.embed.indices" in f.keys() and "model.embed.values" in f.keys()
    (part,) = next((store_dir / "anchors").iterdir()).iterdir()
    with safetensors.safe_open(str(part), "np") as f:
        assert f.metadata()["sparse"] == "False"
        assert sorted(f.keys()) == sorted(model.tensors)
    out = tmp_path / "out.safetensors"
    run_cli("pull", "--store", store_dir, "-o", out)
    assert_identical(out, model.snapshot(), 2)


def test_errors_never_echo_the_query_signature_or_the_bearer_token(run_cli, dav, tmp_path):
    # A presigned-style URL and a bearer token, against a server whose error pages echo the
    # request: the error names the object and the status, never the signature or the token.
    dav.deny_with_echo = True
    signature, token = "sig-0123456789abcdef", "tok-fedcba9876543210"
    store = f"{dav.url}?X-Amz-Expires=3600&X-Amz-Signature={signature}"
    model, ckpt = SyntheticModel(5), tmp_path / "ckpt.safetensors"
    model.save(ckpt)
    env = {"DELTASYNC_HTTP_BEARER_TOKEN": token, "DELTASYNC_STORE_RETRY_BASE_MS": "1"}
    for args in (("publish", ckpt, "--store", store, "--version", 1, "--quiet"),
                 ("pull", "--store", store, "-o", tmp_path / "out.safetensors", "--version", 1, "--quiet")):
        result = run_cli(*args, check=False, env=env)
        assert result.returncode != 0
        assert "HTTP 403" in result.stderr and dav.url in result.stderr, result.stderr
        assert signature not in result.stderr and token not in result.stderr, result.stderr


def test_pull_follow_keeps_out_at_the_newest_version(run_cli, deltasync_bin, tmp_path):
    import subprocess
    store = str(tmp_path / "store")
    out = tmp_path / "follower.safetensors"
    follower = subprocess.Popen([str(deltasync_bin / "deltasync"), "pull", "--store", store, "-o", str(out),
                                 "--follow", "0.05", "--until-version", "6", "--quiet"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        versions = publish_versions(run_cli, tmp_path, store, 6)
        stdout, stderr = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert follower.returncode == 0, stderr
    reported = [int(line.split(" -> ")[1].split()[0]) for line in stdout.splitlines()]
    assert reported and reported[-1] == 6 and reported == sorted(reported), stdout
    assert_identical(out, versions[6], 6)
