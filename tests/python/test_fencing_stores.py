"""Fencing on real store protocols: moto S3 (signature-checking, If-Match / If-None-Match) and the
Hugging Face gateway emulator in its strictest form, which answers every object GET (LATEST's
included, 404s included) with a redirect to a CDN whose ETags are its own.

- a second run on one store is refused with one line and writes nothing;
- --take-over (the CLI) and take_over=True (DeltaPublisher) take it over with a new epoch;
- a restart of the same run takes a new epoch and resumes from the store; the old epoch's
  publisher, still alive, is refused from then on and nothing it writes becomes visible;
- LATEST's compare-and-swap works through the redirecting gateway: its tag is the gateway's, never
  the CDN's."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hf_gateway import GatewayEmulator  # noqa: E402
from moto_s3 import start_signed_moto  # noqa: E402
from store_model import SyntheticModel, assert_identical  # noqa: E402

BUCKET = "deltasync-fencing"


@pytest.fixture(scope="module")
def moto_s3():
    server = start_signed_moto(BUCKET)
    yield server
    server.stop()


@pytest.fixture
def gateway(moto_s3):
    g = GatewayEmulator(moto_s3.host, moto_s3.port, redirect_every_get=True).start()
    yield g
    g.stop()


def quick(env):
    return dict(env, DELTASYNC_STORE_RETRY_BASE_MS="20", DELTASYNC_STORE_RETRIES="3")


@pytest.fixture(params=["s3", "hf", "s3-via-gateway"])
def target(request, moto_s3, gateway):
    """(store URL, environment for the CLI and the C++ store, gateway or None). s3-via-gateway:
    an s3:// URL whose AWS_ENDPOINT_URL is the redirecting gateway (how S3 tools reach an HF
    bucket): nothing tells the store in advance that its GETs will come back from a CDN."""
    prefix = f"{request.node.name.split('[')[0]}-{request.param}"
    if request.param == "s3":
        env = quick(dict(moto_s3.env))
        return f"s3://{BUCKET}/{prefix}", env, None
    if request.param == "s3-via-gateway":
        env = quick(dict(moto_s3.env, AWS_ENDPOINT_URL=gateway.url))
        return f"s3://{BUCKET}/{prefix}", env, gateway
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env = quick(dict(env, DELTASYNC_HF_S3_ENDPOINT=gateway.url, DELTASYNC_HF_ACCESS_KEY_ID=moto_s3.key_id,
                     DELTASYNC_HF_SECRET_ACCESS_KEY=moto_s3.secret))
    return f"hf://buckets/tester/{BUCKET}/{prefix}", env, gateway


def keys(moto_s3, store):
    import boto3
    prefix = store.split(BUCKET + "/", 1)[1] + "/"
    s3 = boto3.client("s3", endpoint_url=moto_s3.endpoint, region_name="us-east-1",
                      aws_access_key_id=moto_s3.key_id, aws_secret_access_key=moto_s3.secret)
    out, kwargs = {}, {"Bucket": BUCKET, "Prefix": prefix}
    while True:
        page = s3.list_objects_v2(**kwargs)
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
        if not page.get("IsTruncated"):
            return out
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


def latest(moto_s3, store):
    import boto3
    s3 = boto3.client("s3", endpoint_url=moto_s3.endpoint, region_name="us-east-1",
                      aws_access_key_id=moto_s3.key_id, aws_secret_access_key=moto_s3.secret)
    key = store.split(BUCKET + "/", 1)[1] + "/LATEST"
    return s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()


def publish(run_cli, tmp_path, model, store, env, version, *flags, check=True):
    ckpt = tmp_path / f"v{version}.safetensors"
    model.save(ckpt)
    return run_cli("publish", ckpt, "--store", store, "--version", version, "--quiet", *flags, env=env, check=check)


def test_another_run_is_refused_and_take_over_is_explicit(run_cli, moto_s3, target, tmp_path):
    store, env, gateway = target
    model = SyntheticModel(3)
    snapshots = {}
    for v in (1, 2, 3):
        if v > 1:
            model.step()
        publish(run_cli, tmp_path, model, store, env, v, "--run-id", "run-a")
        snapshots[v] = model.snapshot()
    # Each CLI publish is a start-up of run-a: a new epoch each time, resumed from the store.
    assert latest(moto_s3, store) == "3\nrun run-a\nepoch 3\nsince 2\n"

    before = keys(moto_s3, store)
    model.step()
    proc = publish(run_cli, tmp_path, model, store, env, 4, "--run-id", "run-b", check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "the store is published by run run-a (epoch 3); refusing to publish run run-b into it" in lines[0]
    assert "--take-over" in lines[0]
    assert keys(moto_s3, store) == before, "a refused run writes nothing"

    publish(run_cli, tmp_path, model, store, env, 4, "--run-id", "run-b", "--take-over")
    snapshots[4] = model.snapshot()
    assert latest(moto_s3, store) == "4\nrun run-b\nepoch 4\nsince 3\n"
    out = tmp_path / "reader.safetensors"
    run_cli("pull", "--store", store, "-o", out, "--quiet", env=env)
    assert_identical(out, snapshots[4], 4)
    # The run that lost the store is refused in turn (taking it back is explicit too).
    model.step()
    proc = publish(run_cli, tmp_path, model, store, env, 5, "--run-id", "run-a", check=False)
    assert proc.returncode == 1 and "published by run run-b (epoch 4)" in proc.stderr

    if gateway:
        # LATEST went through the redirecting gateway: read via the CDN, swapped with the
        # gateway's own tags (If-Match), never with one the CDN made up.
        assert any(p.split("?")[0].endswith("/LATEST") for m, p, h in gateway.gateway_requests if m == "GET")
        swaps = [h for m, p, h in gateway.gateway_requests if m == "PUT" and p.split("?")[0].endswith("/LATEST")]
        tags = [v for h in swaps for k, v in h.items() if k.lower() == "if-match"]
        assert len(tags) >= 6 and not [t for t in tags if "cdn-" in t], tags
        assert gateway.cdn_requests and not gateway.refused


def test_a_restart_fences_off_the_old_epoch(moto_s3, target, tmp_path, monkeypatch, run_cli):
    torch = pytest.importorskip("torch")
    import deltasync
    import deltasync.publisher
    from deltasync.errors import DeltaSyncError

    store, env, _ = target
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    g = torch.Generator().manual_seed(5)
    weights = {"a": torch.randn(64, 32, generator=g).to(torch.bfloat16), "b": torch.randn(100, generator=g).to(torch.bfloat16)}

    def step(model, seed):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in model.values():
                bits = t.view(-1).view(torch.int16)
                bits[torch.randint(0, bits.numel(), (20,), generator=gen)] += 1

    zombie = deltasync.DeltaPublisher(weights, store=store, run_id="trainer-7", anchor_every=3)
    for v in range(3):
        if v:
            step(weights, v)
        zombie.publish(v)
        zombie.flush()

    restarted_weights = {k: torch.zeros_like(t) for k, t in weights.items()}
    assert zombie.fence == {"run_id": "trainer-7", "epoch": 1, "since": None}
    with deltasync.DeltaPublisher(restarted_weights, store=store, run_id="trainer-7", anchor_every=3, resume=True) as restarted:
        assert restarted.resumed_version == 2
        assert restarted.fence == {"run_id": "trainer-7", "epoch": 2, "since": 2}
        assert all(torch.equal(restarted_weights[k].view(torch.int16), weights[k].view(torch.int16)) for k in weights)
        assert latest(moto_s3, store) == "2\nrun trainer-7\nepoch 2\nsince 2\n"
        step(restarted_weights, 50)
        restarted.publish(3)
        restarted.flush()

        # The old epoch, still alive, publishes 4: refused, nothing of it visible.
        step(weights, 60)
        with pytest.raises(DeltaSyncError, match=r"run trainer-7 \(epoch 1\) was fenced off: the store is now run trainer-7 \(epoch 2\)"):
            zombie.publish(4)
            zombie.flush()
        assert not [k for k in keys(moto_s3, store) if "/manifests/" in k and k.endswith(f"{4:020d}.json")]
        assert not [k for k in keys(moto_s3, store) if f"/deltas/{4:020d}-" in k]
        reader = deltasync.DeltaSubscriber({k: torch.zeros_like(t) for k, t in weights.items()}, store)
        assert reader.poll() == 3

        step(restarted_weights, 70)
        restarted.publish(4)
        restarted.flush()
    out = tmp_path / "reader.safetensors"
    run_cli("pull", "--store", store, "-o", out, "--quiet", env=env)
    from store_model import read_safetensors
    got, _ = read_safetensors(out)
    for k, t in restarted_weights.items():
        assert got[k].tobytes() == t.view(torch.int16).numpy().tobytes(), k
    with pytest.raises(DeltaSyncError):
        zombie.close()


def test_take_over_keyword_of_the_python_publisher(tmp_path):
    torch = pytest.importorskip("torch")
    import deltasync
    import deltasync.publisher
    from deltasync.errors import DeltaSyncError

    store = f"file://{tmp_path / 'store'}"
    weights = {"w": torch.ones(8, 8, dtype=torch.bfloat16)}
    with deltasync.DeltaPublisher(weights, store=store, run_id="first") as pub:
        pub.publish(1)
    assert deltasync.publisher.publisher_defaults()["take_over"] is False
    with pytest.raises(DeltaSyncError, match="published by run first"):
        deltasync.DeltaPublisher(weights, store=store, run_id="second")
    with deltasync.DeltaPublisher(weights, store=store, run_id="second", take_over=True, resume=True) as pub:
        assert pub.resumed_version == 1
        weights["w"][0, 0] = 2
        pub.publish(2)
    assert (tmp_path / "store" / "LATEST").read_text() == "2\nrun second\nepoch 2\nsince 1\n"
