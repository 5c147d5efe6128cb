"""Listing and the Hugging Face bucket gateway against the signature-checking moto server.

Listing: `log`, retention and the subscriber's listing fallback all send ListObjectsV2; with
pages of 2 keys, continuation tokens shaped like AWS's ('+', '/', '=') and a prefix with ' ',
'+' and '=', every request must pass moto's SigV4 check — through s3:// and through hf://.
Gateway: hf://buckets/NAMESPACE/BUCKET/PREFIX goes through a local gateway emulator that answers
every object GET with 302 to a CDN on another loopback address; a pull succeeds, the CDN never
sees Authorization or any x-amz-* header, and the pre-signed query is never printed."""
import json
import os
import sys
import urllib.parse

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fault_proxy import FaultProxy  # noqa: E402
from hf_gateway import SIGNATURE_MARK, GatewayEmulator  # noqa: E402
from moto_s3 import start_signed_moto  # noqa: E402
from store_model import SyntheticModel, assert_identical, read_safetensors  # noqa: E402

BUCKET = "deltasync-listing"
NAMESPACE = "tester"


@pytest.fixture(scope="module")
def moto_s3():
    server = start_signed_moto(BUCKET, aws_like_tokens=True)
    yield server
    server.stop()


@pytest.fixture
def gateway(moto_s3):
    g = GatewayEmulator(moto_s3.host, moto_s3.port).start()
    yield g
    g.stop()


def boto(moto_s3):
    import boto3
    return boto3.client("s3", endpoint_url=moto_s3.endpoint, region_name="us-east-1",
                        aws_access_key_id=moto_s3.key_id, aws_secret_access_key=moto_s3.secret)


def quick(env):
    return dict(env, DELTASYNC_STORE_RETRY_BASE_MS="20", DELTASYNC_STORE_RETRIES="2", DELTASYNC_STORE_LIST_PAGE="2")


def s3_target(moto_s3, endpoint, prefix):
    env = quick({"AWS_ACCESS_KEY_ID": moto_s3.key_id, "AWS_SECRET_ACCESS_KEY": moto_s3.secret,
                 "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint})
    return f"s3://{BUCKET}/{prefix}", env


def hf_target(moto_s3, endpoint, prefix):
    # The deltasync-specific pair; AWS_* are left unset so nothing else can sign.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env = quick(dict(env, DELTASYNC_HF_S3_ENDPOINT=endpoint, DELTASYNC_HF_ACCESS_KEY_ID=moto_s3.key_id,
                     DELTASYNC_HF_SECRET_ACCESS_KEY=moto_s3.secret))
    return f"hf://buckets/{NAMESPACE}/{BUCKET}/{prefix}", env


def publish_versions(run_cli, tmp_path, store, env, versions, **options):
    model = SyntheticModel(7)
    snapshots = {}
    state = tmp_path / "state"
    for v in versions:
        if v != versions[0]:
            model.step()
        ckpt = tmp_path / "current.safetensors"
        model.save(ckpt)
        snapshots[v] = model.snapshot()
        args = [f"--{k.replace('_', '-')}" if i == 0 else str(x) for k, val in options.items() for i, x in enumerate((k, val))]
        run_cli("publish", ckpt, "--store", store, "--version", v, "--state", state, "--quiet", *args, env=env)
    return snapshots


def keys_under(moto_s3, prefix):
    out, kwargs = [], {"Bucket": BUCKET, "Prefix": prefix}
    while True:
        page = boto(moto_s3).list_objects_v2(**kwargs)
        out += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return out
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


@pytest.mark.parametrize("scheme", ["s3", "hf"])
def test_log_retention_and_listing_fallback_pass_signature_checks(run_cli, moto_s3, gateway, tmp_path, scheme):
    prefix = f"runs/{scheme} 1+a=b"
    if scheme == "s3":
        recorder = FaultProxy(moto_s3.host, moto_s3.port).start()
        store, env = s3_target(moto_s3, recorder.url, prefix)
    else:
        recorder = None
        store, env = hf_target(moto_s3, gateway.url, prefix)
    try:
        snapshots = publish_versions(run_cli, tmp_path, store, env, list(range(1, 9)), anchor_every=2, keep_anchors=2)

        # log: every manifest, page by page (2 keys a page).
        listing = json.loads(run_cli("log", "--store", store, "--json", env=env).stdout)
        versions = [m["version"] for m in listing["versions"]]
        assert listing["latest"] == 8
        # Retention kept the newest 2 anchors (versions 7 and 5) and everything from 5 on.
        assert versions == [5, 6, 7, 8], versions
        remaining = keys_under(moto_s3, prefix + "/")
        assert not [k for k in remaining if "/manifests/" in k and int(k.rsplit("/", 1)[1].split(".")[0]) < 5]
        anchors_left = {k.split("/anchors/")[1].split("-")[0] for k in remaining if "/anchors/" in k}
        assert {int(a) for a in anchors_left} == {5, 7}, anchors_left

        # Listing fallback: without LATEST a new reader finds the newest version by listing.
        boto(moto_s3).delete_object(Bucket=BUCKET, Key=prefix + "/LATEST")
        out = tmp_path / "reader.safetensors"
        run_cli("pull", "--store", store, "-o", out, "--quiet", env=env)
        assert_identical(out, snapshots[8], 8)
        listing = json.loads(run_cli("log", "--store", store, "--json", env=env).stdout)
        assert listing["latest"] is None and [m["version"] for m in listing["versions"]] == [5, 6, 7, 8]

        # The listings did page with AWS-shaped tokens, encoded as SigV4 wants them.
        paths = [r[1] for r in (recorder.requests if recorder else gateway.gateway_requests)]
        tokens = [p for p in paths if "continuation-token=" in p]
        assert tokens and all("%2B" in p and "%2F" in p and "%3D" in p for p in tokens), tokens[:3]
        assert any("prefix=runs%2F" in p and "%20" in p and "%2B" in p and "%3D" in p for p in paths)
        if scheme == "hf":
            assert any("delimiter=%2F" in p for p in paths)  # the gateway lists one folder at a time
            assert not gateway.refused, gateway.refused
    finally:
        if recorder:
            recorder.stop()


def test_pull_through_the_gateway_follows_redirects_without_credentials(run_cli, moto_s3, gateway, tmp_path):
    store, env = hf_target(moto_s3, gateway.url, "pull-run")
    snapshots = publish_versions(run_cli, tmp_path, store, env, [1, 2, 3])
    out = tmp_path / "replica.safetensors"
    # Small ranges: the anchor comes down as several ranged GETs, each redirected.
    pull_env = dict(env, DELTASYNC_STORE_PART_SIZE="8192", DELTASYNC_STORE_MULTIPART_THRESHOLD="8192")
    proc = run_cli("pull", "--store", store, "-o", out, "--version", 2, env=pull_env)
    assert_identical(out, snapshots[2], 2)
    proc2 = run_cli("pull", "--store", store, "-o", out, env=pull_env)
    assert "version 2 -> 3" in proc2.stdout
    assert_identical(out, snapshots[3], 3)

    assert len(gateway.cdn_requests) >= 4, gateway.cdn_requests
    ranged = [h for _, _, h in gateway.cdn_requests if any(k.lower() == "range" for k in h)]
    assert len(ranged) >= 2
    for method, path, headers in gateway.cdn_requests:
        names = [k.lower() for k in headers]
        assert method == "GET" and f"X-Amz-Signature={SIGNATURE_MARK}" in path
        assert "authorization" not in names and not [n for n in names if n.startswith("x-amz-")], headers
        assert gateway.upstream[1] and "if-match" not in names and "if-none-match" not in names
    for text in (proc.stdout, proc.stderr, proc2.stdout, proc2.stderr):
        assert SIGNATURE_MARK not in text
    assert not gateway.refused, gateway.refused
    # LATEST is moved with a compare-and-swap: If-None-Match on create, If-Match afterwards; each
    # publish claims the store (a new epoch) and then moves it to its version.
    latest_puts = [h for m, p, h in gateway.gateway_requests if m == "PUT" and p.split("?")[0].endswith("/LATEST")]
    assert "If-None-Match" in latest_puts[0] and all("If-Match" in h for h in latest_puts[1:]) and len(latest_puts) == 6, latest_puts


def test_a_redirect_to_plain_http_off_loopback_is_refused_without_printing_its_query(run_cli, moto_s3, gateway, tmp_path):
    refusing = GatewayEmulator(moto_s3.host, moto_s3.port, redirect_base="http://cdn.example.invalid").start()
    try:
        # Published through a sound gateway (publishing reads LATEST too), pulled through the bad one.
        publish_versions(run_cli, tmp_path, *hf_target(moto_s3, gateway.url, "refused-run"), [1])
        store, env = hf_target(moto_s3, refusing.url, "refused-run")
        proc = run_cli("pull", "--store", store, "-o", tmp_path / "r.safetensors", env=env, check=False)
        assert proc.returncode == 1
        assert "which is not HTTPS; refusing to follow" in proc.stderr, proc.stderr
        assert SIGNATURE_MARK not in proc.stderr + proc.stdout
        assert not os.path.exists(tmp_path / "r.safetensors")
    finally:
        refusing.stop()


def test_keys_and_urls_outside_the_gateways_rules_are_refused_before_sending(run_cli, moto_s3, gateway, tmp_path):
    for bad, reason in [("a/../b", "'..' segment"), ("a//b", "'//'"), ("a\\b", "'\\'")]:
        store, env = hf_target(moto_s3, gateway.url, bad)
        proc = run_cli("log", "--store", store, env=env, check=False)
        assert proc.returncode == 1 and "not a valid Hugging Face bucket prefix" in proc.stderr and reason in proc.stderr
    assert not gateway.gateway_requests
    proc = run_cli("log", "--store", "hf://buckets/only-namespace", env=env, check=False)
    assert proc.returncode == 1 and "expected hf://buckets/NAMESPACE/BUCKET" in proc.stderr
