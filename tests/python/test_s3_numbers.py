"""Numbers in S3 answers (a listing's <Size>, a ranged GET's Content-Range total) go through the
one strict number parser: a sign, a space or trailing text is refused in one line naming the
object, where the S3 store's own std::stoull variant took "+5" and " 5" as 5 and "-1" as 2^64-1.
The server is a hand-made S3 on 127.0.0.1 that answers with exactly the text a test gives it (no
signature check: what is under test is the reading of its answers)."""
import os
import sys
import threading
import urllib.parse

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fault_proxy import QuietHandler, ThreadingServer  # noqa: E402

BUCKET = "numbers"


class HandMadeS3:
    def __init__(self):
        self.size_text = None      # <Size> of the one manifest a listing shows; None: empty listing
        self.latest_total = None   # Content-Range total of a ranged GET of LATEST; None: 404
        server = self

        class Handler(QuietHandler):
            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                if query.get("list-type") == ["2"]:
                    contents = ""
                    if server.size_text is not None:
                        contents = (f"<Contents><Key>{query['prefix'][0]}00000000000000000001.json</Key>"
                                    f"<Size>{server.size_text}</Size><ETag>\"e\"</ETag></Contents>")
                    body = ('<?xml version="1.0" encoding="UTF-8"?>'
                            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                            f"<Name>{BUCKET}</Name><IsTruncated>false</IsTruncated>{contents}</ListBucketResult>")
                    return self.send_all(200, [("Content-Type", "application/xml")], body.encode())
                if url.path.endswith("/LATEST") and server.latest_total is not None:
                    return self.send_all(206, [("Content-Range", f"bytes 0-1/{server.latest_total}")], b"1\n")
                self.send_all(404, [("Content-Type", "application/xml")], b"<Error><Code>NoSuchKey</Code></Error>")

        self.httpd = ThreadingServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def s3():
    with HandMadeS3() as server:
        yield server


def log(run_cli, s3):
    env = {"AWS_ACCESS_KEY_ID": "AKIDNUMBERS", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": s3.endpoint, "DELTASYNC_STORE_RETRIES": "1"}
    return run_cli("log", "--store", f"s3://{BUCKET}/run", env=env, check=False)


def one_line_error(proc):
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_the_hand_made_server_is_read_when_its_numbers_are_plain(run_cli, s3):
    proc = log(run_cli, s3)
    assert proc.returncode == 0 and "0 versions; LATEST -> (none)" in proc.stdout, proc.stderr
    s3.latest_total = "2"
    proc = log(run_cli, s3)
    assert proc.returncode == 0 and "LATEST -> 1" in proc.stdout, proc.stderr


@pytest.mark.parametrize("size", ["+5", " 5", "-1", "5x", "18446744073709551616"])
def test_a_listing_size_that_is_not_plain_digits_is_refused(run_cli, s3, size):
    s3.size_text = size
    line = one_line_error(log(run_cli, s3))
    assert f"LIST Size of run/manifests/00000000000000000001.json '{size}': " in line, line
    assert ("out of range (max 18446744073709551615)" if size.isdigit()
            else "not a decimal integer") in line, line


@pytest.mark.parametrize("total", ["+2", " 2", "-1"])
def test_a_content_range_total_with_a_sign_or_a_space_is_refused(run_cli, s3, total):
    s3.latest_total = total
    line = one_line_error(log(run_cli, s3))
    assert f"LATEST: GET Content-Range total '{total}': not a decimal integer" in line, line
