"""Many replicas following one S3 store (moto on loopback) without a thundering herd.

- An idle follower costs one conditional GET of LATEST per poll (If-None-Match), answered 304
  without a body: counted at a proxy in front of moto. Through the Hugging Face gateway emulator
  (every GET redirected to a CDN) it costs one HEAD.
- What each update cost is in the subscriber's report (store_requests: every request since the
  previous report, the idle polls included), and it matches what the proxy saw.
- 16 follower processes (`deltasync pull --follow`) follow one store for 50 versions: every one
  ends bit-exact with the trainer, and the requests per version of each are printed as a table
  (no timing assertions)."""
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import deltasync  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from fault_proxy import FaultProxy  # noqa: E402
from moto_s3 import start_signed_moto  # noqa: E402
from store_model import read_safetensors  # noqa: E402

BUCKET = "deltasync-followers"


@pytest.fixture(scope="module")
def moto_s3():
    server = start_signed_moto(BUCKET)
    yield server
    server.stop()


@pytest.fixture
def proxied(moto_s3, monkeypatch):
    """A proxy in front of moto, and the environment pointing the C++ S3 store at it."""
    proxy = FaultProxy(moto_s3.host, moto_s3.port).start()
    env = dict(moto_s3.env, AWS_ENDPOINT_URL=proxy.url, DELTASYNC_STORE_RETRY_BASE_MS="20")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield proxy, env
    proxy.stop()


def model(seed):
    g = torch.Generator().manual_seed(seed)
    return {"layers.0.weight": torch.randn(128, 96, generator=g).to(torch.bfloat16),
            "layers.1.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
            "norm": torch.randn(64, generator=g).to(torch.bfloat16)}


def step(weights, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in weights.values():
            bits = t.view(-1).view(torch.int16)
            bits[torch.randint(0, bits.numel(), (max(1, bits.numel() // 100),), generator=g)] += 1


def bits(t):
    return t.view(torch.int16).numpy().tobytes()


def test_an_idle_follower_costs_one_conditional_request_per_poll(proxied, request):
    proxy, _ = proxied
    store = f"s3://{BUCKET}/{request.node.name}"
    trainer = model(1)
    replica = {k: torch.zeros_like(t) for k, t in trainer.items()}
    with deltasync.DeltaPublisher(trainer, store=store, run_id="idle") as pub:
        pub.publish(1)
        pub.flush()
        sub = deltasync.DeltaSubscriber(replica, store)
        assert sub.update() == 1

        proxy.clear()
        polls = 25
        for _ in range(polls):
            assert sub.poll() == 1
        latest_path = f"/{BUCKET}/{request.node.name}/LATEST"
        assert len(proxy.answers) == polls, proxy.answers
        for method, path, conditional, status, body in proxy.answers:
            assert (method, path.split("?")[0]) == ("GET", latest_path)
            assert conditional, "the poll is conditional (If-None-Match)"
            assert (status, body) == (304, 0), "answered without a body"

        # The next update's report counts those polls and what the update itself sent.
        step(trainer, 2)
        pub.publish(2)
        pub.flush()
        proxy.clear()
        assert sub.update() == 2
        report = sub.last_report
        assert report.deltas == [2]
        # The update: a poll that finds the new LATEST, the manifest, the delta; nothing more.
        assert len(proxy.requests) == 3, proxy.requests
        assert report.store_requests == polls + len(proxy.requests), (report.store_requests, proxy.requests)
    assert all(bits(replica[k]) == bits(trainer[k]) for k in trainer)


UPDATE = re.compile(r": version (\w+) -> (\d+) via .*, (\d+) store requests")


def test_sixteen_followers_fifty_versions(proxied, request, deltasync_bin, tmp_path):
    proxy, env = proxied
    store = f"s3://{BUCKET}/{request.node.name}"
    followers, versions = 16, 50
    trainer = model(7)
    with deltasync.DeltaPublisher(trainer, store=store, run_id="herd", anchor_every=20) as pub:
        pub.publish(0)
        pub.flush()
        procs = []
        for i in range(followers):
            out = tmp_path / f"replica-{i}.safetensors"
            procs.append((out, subprocess.Popen(
                [str(deltasync_bin / "deltasync"), "pull", "--store", store, "-o", str(out), "--follow", "0.2",
                 "--until-version", str(versions), "--quiet"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})))
        for v in range(1, versions + 1):
            step(trainer, 1000 + v)
            pub.publish(v)
            pub.flush()
        final = {k: bits(t) for k, t in trainer.items()}
    rows = []
    for i, (out, proc) in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        got, meta = read_safetensors(out)
        assert meta.get("model_version") == str(versions)
        assert {k: a.tobytes() for k, a in got.items()} == final, f"follower {i} differs from the trainer"
        updates = [UPDATE.search(line) for line in stdout.splitlines()]
        updates = [u for u in updates if u]
        assert updates and int(updates[-1].group(2)) == versions, stdout
        first = int(updates[0].group(1)) if updates[0].group(1) != "none" else -1
        requests = sum(int(u.group(3)) for u in updates)
        covered = versions - first
        rows.append((i, len(updates), covered, requests, requests / covered))
    print(f"\n{followers} followers of one S3 store (moto on loopback), {versions} versions, poll 0.2 s jittered +-50%")
    print(f"{'follower':>8} {'updates':>8} {'versions':>9} {'requests':>9} {'req/version':>12}")
    for i, n, covered, requests, per in rows:
        print(f"{i:>8} {n:>8} {covered:>9} {requests:>9} {per:>12.2f}")
    total = sum(r[3] for r in rows)
    print(f"{'all':>8} {sum(r[1] for r in rows):>8} {sum(r[2] for r in rows):>9} {total:>9} {total / sum(r[2] for r in rows):>12.2f}")
    assert total <= len(proxy.requests), "a follower cannot have sent more than the proxy saw"


def test_an_idle_follower_through_the_hf_gateway_costs_one_head_per_poll(moto_s3, monkeypatch, request):
    """Through the gateway a GET goes on to the CDN, whose tags are not the gateway's: the poll
    compares the gateway's tag from a HEAD, so an idle one is a HEAD and nothing else."""
    from hf_gateway import GatewayEmulator
    gateway = GatewayEmulator(moto_s3.host, moto_s3.port, redirect_every_get=True).start()
    try:
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            monkeypatch.delenv(k)
        for k, v in {"DELTASYNC_HF_S3_ENDPOINT": gateway.url, "DELTASYNC_HF_ACCESS_KEY_ID": moto_s3.key_id,
                     "DELTASYNC_HF_SECRET_ACCESS_KEY": moto_s3.secret}.items():
            monkeypatch.setenv(k, v)
        store = f"hf://buckets/tester/{BUCKET}/{request.node.name}"
        trainer = model(3)
        replica = {k: torch.zeros_like(t) for k, t in trainer.items()}
        with deltasync.DeltaPublisher(trainer, store=store, run_id="idle-hf") as pub:
            pub.publish(1)
            pub.flush()
        sub = deltasync.DeltaSubscriber(replica, store)
        assert sub.update() == 1
        with gateway.lock:
            gateway.gateway_requests.clear()
            gateway.cdn_requests.clear()
        for _ in range(10):
            assert sub.poll() == 1
        assert [(m, p.split("?")[0].rsplit("/", 1)[-1]) for m, p, _ in gateway.gateway_requests] == [("HEAD", "LATEST")] * 10
        assert not gateway.cdn_requests
        assert all(bits(replica[k]) == bits(trainer[k]) for k in trainer)
    finally:
        gateway.stop()
