"""The S3 store end to end: the deltasync CLI against moto (signature checking on) on 127.0.0.1,
directly and through a fault-injecting proxy. Scenarios from issue 4: a reader following 50+
versions as they are published, a late reader, a reader that missed versions, a reader whose
weights were corrupted, wrong credentials, a publisher killed mid-upload, transient faults,
redirects, multipart upload and parallel ranged download. Every reader must end bit-identical."""
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.parse

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fault_proxy import FaultProxy  # noqa: E402
from moto_s3 import start_signed_moto  # noqa: E402
from store_model import SyntheticModel, assert_identical, read_safetensors  # noqa: E402

BUCKET = "deltasync-test"


@pytest.fixture(scope="module")
def moto_s3():
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    server = start_signed_moto(BUCKET)
    yield server
    server.stop()


@pytest.fixture
def proxy(moto_s3):
    p = FaultProxy(moto_s3.host, moto_s3.port).start()
    yield p
    p.stop()


def s3_env(moto_s3, endpoint=None, **extra):
    env = {
        "AWS_ACCESS_KEY_ID": moto_s3.key_id,
        "AWS_SECRET_ACCESS_KEY": moto_s3.secret,
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint or moto_s3.endpoint,
        "DELTASYNC_STORE_RETRY_BASE_MS": "20",  # quick backoff in tests
        "DELTASYNC_STORE_LOW_SPEED_TIME": "2",  # a stalled transfer is dropped (and retried) after 2 s
    }
    env.pop("AWS_SESSION_TOKEN", None)
    env.update(extra)
    return env


def store_url(request):
    return f"s3://{BUCKET}/{request.node.name}"


class Trainer:
    """Publishes a synthetic model through the CLI and remembers every version's weights."""

    def __init__(self, run_cli, tmp_path, store, env, seed=0, shapes=None, anchor_every=10):
        self.run_cli, self.store, self.env = run_cli, store, env
        self.model = SyntheticModel(seed) if shapes is None else SyntheticModel(seed, shapes)
        self.dir = tmp_path / "trainer"
        self.dir.mkdir(exist_ok=True)
        self.state = self.dir / "state"
        self.anchor_every = anchor_every
        self.versions = {}
        self.version = 0

    def publish(self, check=True, step=True, **kw):
        if step and self.version:
            self.model.step()
        self.version += 1
        ckpt = self.dir / "current.safetensors"
        self.model.save(ckpt)
        self.versions[self.version] = self.model.snapshot()
        return self.run_cli("publish", ckpt, "--store", self.store, "--version", self.version, "--state", self.state,
                            "--anchor-every", self.anchor_every, "--quiet", check=check, env=self.env, **kw)


def pulled_version(path):
    return int(read_safetensors(path)[1]["model_version"])


def test_reader_follows_fifty_versions_and_late_and_lagging_readers_catch_up(run_cli, moto_s3, tmp_path, request):
    # Listing pages of 7 keys: every listing (log, retention, catch-up) paginates.
    store, env = store_url(request), s3_env(moto_s3, DELTASYNC_STORE_LIST_PAGE="7")
    trainer = Trainer(run_cli, tmp_path, store, env)
    trainer.publish()
    follower_out = tmp_path / "follower.safetensors"
    seen, errors, done = [], [], threading.Event()

    def follow():
        # Polls while the trainer publishes; every version it reports must be bit-exact.
        try:
            while True:
                finished = done.is_set()
                run_cli("pull", "--store", store, "-o", follower_out, "--quiet", env=env)
                v = pulled_version(follower_out)
                assert_identical(follower_out, trainer.versions[v], v)
                if not seen or seen[-1] != v:
                    seen.append(v)
                if finished:
                    return
        except Exception as e:  # surfaced in the main thread
            errors.append(e)

    lagging_out = tmp_path / "lagging.safetensors"
    reader = threading.Thread(target=follow)
    reader.start()
    for v in range(2, 53):
        trainer.publish()
        if v == 10:
            run_cli("pull", "--store", store, "-o", lagging_out, env=env)
    done.set()
    reader.join(timeout=120)
    assert not errors, errors[0]
    assert seen[-1] == 52 and len(seen) >= 3 and seen == sorted(seen)

    # A reader that missed 42 versions, and one that joins now, both end at the newest version.
    out = run_cli("pull", "--store", store, "-o", lagging_out, env=env).stdout
    assert "version 10 -> 52" in out
    assert_identical(lagging_out, trainer.versions[52], 52)
    late_out = tmp_path / "late.safetensors"
    out = run_cli("pull", "--store", store, "-o", late_out, env=env).stdout
    assert "via anchor" in out, out
    assert_identical(late_out, trainer.versions[52], 52)

    # A pinned older version, and the log.
    pinned = tmp_path / "pinned.safetensors"
    run_cli("pull", "--store", store, "-o", pinned, "--version", 50, env=env)
    assert_identical(pinned, trainer.versions[50], 50)
    log = run_cli("log", "--store", store, "--json", env=env).stdout
    listing = json.loads(log)
    assert listing["latest"] == 52
    versions = [m["version"] for m in listing["versions"]]
    assert versions[-1] == 52 and versions == sorted(versions)
    kinds = {m["version"]: m["kind"] for m in listing["versions"]}
    assert any(k.startswith("anchor") for k in kinds.values())
    # Retention (3 anchors kept by default) removed the oldest versions.
    assert versions[0] > 1
    delta_sizes = [m["delta"]["size"] for m in listing["versions"] if m["delta"]]
    full = listing["versions"][-1]["model_bytes"]
    assert max(delta_sizes) < full / 4, (delta_sizes, full)


def test_corrupted_reader_recovers_from_an_anchor(run_cli, moto_s3, tmp_path, request):
    store, env = store_url(request), s3_env(moto_s3)
    trainer = Trainer(run_cli, tmp_path, store, env, anchor_every=4)
    for _ in range(6):
        trainer.publish()
    out_path = tmp_path / "reader.safetensors"
    run_cli("pull", "--store", store, "-o", out_path, env=env)
    # Flip one bit of one weight without touching the header: the file still claims version 6.
    raw = bytearray(out_path.read_bytes())
    raw[-3] ^= 0x10
    out_path.write_bytes(bytes(raw))
    trainer.publish()
    result = run_cli("pull", "--store", store, "-o", out_path, env=env)
    assert "recovered from an anchor" in result.stdout, result.stdout
    assert_identical(out_path, trainer.versions[7], 7)


def test_wrong_credentials_fail_with_a_clear_error_and_no_secret(run_cli, moto_s3, tmp_path, request):
    store = store_url(request)
    trainer = Trainer(run_cli, tmp_path, store, s3_env(moto_s3))
    trainer.publish()
    bad_secret = "definitely-not-the-secret-4242"
    for env in (s3_env(moto_s3, AWS_SECRET_ACCESS_KEY=bad_secret), s3_env(moto_s3, AWS_ACCESS_KEY_ID="AKIAUNKNOWN000000000")):
        result = run_cli("pull", "--store", store, "-o", tmp_path / "x.safetensors", check=False, env=env)
        assert result.returncode != 0
        err = result.stderr.strip()
        assert len(err.splitlines()) == 1, err
        assert "HTTP 403" in err and store in err, err
        assert "AWS_SECRET_ACCESS_KEY" in err  # says what to check...
        assert bad_secret not in err and moto_s3.secret not in err  # ...never what it is
    # Missing credentials are caught before any request.
    env = s3_env(moto_s3)
    env["AWS_ACCESS_KEY_ID"] = ""
    result = run_cli("log", "--store", store, check=False, env=env)
    assert result.returncode != 0 and "AWS_ACCESS_KEY_ID" in result.stderr


def test_publisher_killed_mid_upload_leaves_no_half_version(run_cli, deltasync_bin, moto_s3, proxy, tmp_path, request):
    store = store_url(request)
    env = s3_env(moto_s3, proxy.url)
    trainer = Trainer(run_cli, tmp_path, store, env, anchor_every=3)
    trainer.publish()
    trainer.publish()
    # Hang the upload of version 3's objects and kill the publisher while it is in flight.
    hang = proxy.add("hang_put", method="PUT", path_contains="00000000000000000003-", seconds=30)
    trainer.model.step()
    trainer.version = 3
    ckpt = trainer.dir / "v3.safetensors"
    trainer.model.save(ckpt)
    trainer.versions[3] = trainer.model.snapshot()
    full_env = dict(os.environ, **env)
    proc = subprocess.Popen([str(deltasync_bin / "deltasync"), "publish", str(ckpt), "--store", store, "--version", "3",
                             "--state", str(trainer.state), "--anchor-every", "3", "--quiet"], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert hang.hit.wait(60), "the publisher never started uploading the anchor"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proxy.clear()

    listing = json.loads(run_cli("log", "--store", store, "--json", env=env).stdout)
    assert [m["version"] for m in listing["versions"]] == [1, 2] and listing["latest"] == 2
    reader = tmp_path / "reader.safetensors"
    run_cli("pull", "--store", store, "-o", reader, env=env)
    assert_identical(reader, trainer.versions[2], 2)

    # The next publish of the same version succeeds (the state was never advanced).
    run_cli("publish", ckpt, "--store", store, "--version", 3, "--state", trainer.state, "--anchor-every", 3, env=env)
    run_cli("pull", "--store", store, "-o", reader, env=env)
    assert_identical(reader, trainer.versions[3], 3)


def test_transient_faults_are_retried(run_cli, moto_s3, proxy, tmp_path, request):
    store = store_url(request)
    env = s3_env(moto_s3, proxy.url)
    trainer = Trainer(run_cli, tmp_path, store, env)
    proxy.add("status", times=2, method="PUT", status=503)
    proxy.add("status", times=1, method="GET", status=429)
    trainer.publish()
    proxy.add("drop", times=2, method="GET", path_contains="/anchors/")
    proxy.add("status", times=1, method="PUT", path_contains="/manifests/", status=500)
    proxy.add("status", times=1, method="PUT", path_contains="/deltas/", status=400, code="RequestTimeout")
    proxy.add("delay", times=3, method="GET", seconds=0.3)
    trainer.publish()
    out_path = tmp_path / "reader.safetensors"
    run_cli("pull", "--store", store, "-o", out_path, env=env)
    assert_identical(out_path, trainer.versions[2], 2)
    # A stalled download (no bytes for longer than the low-speed window) is dropped and retried.
    trainer.publish()
    proxy.add("stall", times=1, method="GET", path_contains="/deltas/", seconds=5)
    run_cli("pull", "--store", store, "-o", out_path, env=env)
    assert_identical(out_path, trainer.versions[3], 3)
    assert all(f.times == 0 for f in proxy.faults), "every injected fault was exercised"


def test_persistent_failure_gives_up_with_a_clear_error(run_cli, moto_s3, proxy, tmp_path, request):
    store = store_url(request)
    env = s3_env(moto_s3, proxy.url, DELTASYNC_STORE_RETRIES="3")
    trainer = Trainer(run_cli, tmp_path, store, env)
    proxy.add("status", times=1000, method="PUT", status=503)
    result = trainer.publish(check=False)
    assert result.returncode != 0
    err = result.stderr.strip()
    assert "PUT failed after 3 attempts: HTTP 503" in err, err
    assert store in err
    assert moto_s3.secret not in err
    proxy.clear()
    listing = json.loads(run_cli("log", "--store", store, "--json", env=env).stdout)
    assert listing["versions"] == []


def test_redirects_are_followed_only_to_the_same_host(run_cli, moto_s3, proxy, tmp_path, request):
    store = store_url(request)
    env = s3_env(moto_s3, proxy.url)
    trainer = Trainer(run_cli, tmp_path, store, env)
    trainer.publish()
    path = urllib.parse.quote(f"/{BUCKET}/{request.node.name}/LATEST")
    proxy.add("redirect", times=1, method="GET", path_contains="/LATEST", location=f"{proxy.url}{path}")
    out_path = tmp_path / "reader.safetensors"
    run_cli("pull", "--store", store, "-o", out_path, env=env)
    assert_identical(out_path, trainer.versions[1], 1)
    # Another host (even another port on loopback) never gets a signed request: a GET redirected
    # there is followed as to a pre-signed URL (no Authorization, no x-amz-* header, no
    # conditional header); the store then takes LATEST's tag from HEADs and reads on.
    other = _RecordingServer()
    try:
        proxy.add("redirect", times=1, method="GET", path_contains="/LATEST", location=f"{other.url}{path}?X-Amz-Signature=s")
        run_cli("pull", "--store", store, "-o", tmp_path / "other.safetensors", env=env)
        assert_identical(tmp_path / "other.safetensors", trainer.versions[1], 1)
        assert other.requests, "the redirect was not followed"
        for method, headers in other.requests:
            names = {k.lower() for k in headers}
            assert method == "GET" and "authorization" not in names, headers
            assert not [n for n in names if n.startswith("x-amz-") or n.startswith("if-")], headers
    finally:
        other.stop()
    # Anything but a GET redirected elsewhere is refused: a PUT carries its signature and body.
    proxy.add("redirect", times=1, method="PUT", location=f"{moto_s3.endpoint}/{BUCKET}/elsewhere")
    result = trainer.publish(check=False)
    assert result.returncode != 0
    assert "PUT redirected to another host" in result.stderr and "refusing to follow" in result.stderr, result.stderr


class _RecordingServer:
    """Another origin: records each request's method and headers, answers 403."""

    def __init__(self):
        from fault_proxy import QuietHandler, ThreadingServer

        self.requests = []
        recorder = self

        class Handler(QuietHandler):
            def _handle(self):
                recorder.requests.append((self.command, dict(self.headers.items())))
                self.send_all(403, [], b"")

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

        self.server = ThreadingServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_large_model_uses_multipart_upload_and_parallel_ranged_gets(run_cli, moto_s3, proxy, tmp_path, request):
    store = store_url(request)
    # 6 MiB parts: a 24 MiB anchor goes up in parts and comes down in ranged GETs.
    env = s3_env(moto_s3, proxy.url, DELTASYNC_STORE_PART_SIZE=str(6 << 20),
                 DELTASYNC_STORE_MULTIPART_THRESHOLD=str(8 << 20), DELTASYNC_STORE_PARALLELISM="4")
    shapes = {"big.weight": (3072, 4096)}
    trainer = Trainer(run_cli, tmp_path, store, env, shapes=shapes)
    trainer.publish()
    puts = [p for m, p in proxy.requests if m == "PUT" and "partNumber=" in p]
    assert len(puts) >= 4, puts
    trainer.publish()
    proxy.clear()
    proxy.add("drop", times=1, method="GET", path_contains="/anchors/")
    out_path = tmp_path / "reader.safetensors"
    run_cli("pull", "--store", store, "-o", out_path, env=env)
    assert_identical(out_path, trainer.versions[2], 2)
    ranged = [p for m, p in proxy.requests if m == "GET" and "/anchors/" in p]
    assert len(ranged) >= 4, ranged


def test_retention_aborts_the_unfinished_uploads_of_deleted_versions(run_cli, moto_s3, tmp_path, request):
    # What a publisher killed mid-part leaves behind: multipart uploads started and never
    # completed. No reader sees them, but S3 keeps their parts until they are aborted.
    import boto3
    store = store_url(request)
    env = s3_env(moto_s3)
    s3 = boto3.client("s3", endpoint_url=moto_s3.endpoint, region_name="us-east-1",
                      aws_access_key_id=moto_s3.key_id, aws_secret_access_key=moto_s3.secret)
    prefix = request.node.name + "/"

    def unfinished(key):
        upload = s3.create_multipart_upload(Bucket=BUCKET, Key=prefix + key)
        s3.upload_part(Bucket=BUCKET, Key=prefix + key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024)

    def pending():
        listed = s3.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
        return sorted(u["Key"][len(prefix):] for u in listed)

    old_delta = "deltas/00000000000000000002-dead.safetensors"
    old_anchor = "anchors/00000000000000000001-dead/part-00000.safetensors"
    future_delta = "deltas/00000000000000000099-live.safetensors"  # a version a writer may still finish
    for key in (old_delta, old_anchor, future_delta):
        unfinished(key)
    assert pending() == sorted([old_delta, old_anchor, future_delta])

    trainer = Trainer(run_cli, tmp_path, store, env, anchor_every=2)
    ckpt = trainer.dir / "current.safetensors"
    for v in range(1, 6):  # anchors at 1, 3, 5: with one anchor kept, versions 1-4 are deleted
        if v > 1:
            trainer.model.step()
        trainer.model.save(ckpt)
        run_cli("publish", ckpt, "--store", store, "--version", v, "--state", trainer.state, "--anchor-every", 2,
                "--keep-anchors", 1, "--quiet", env=env)
    listing = json.loads(run_cli("log", "--store", store, "--json", env=env).stdout)
    assert [m["version"] for m in listing["versions"]] == [5]
    # The uploads of deleted versions are gone; the one of a version still ahead is left alone.
    assert pending() == [future_delta]
