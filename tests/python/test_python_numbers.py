"""Versions read on the Python side (vLLM's /weight_info, the backend's update_info) go through the
C++ number rule (core/parse_number.hpp), bound once: digits only, no sign, no spaces, in range."""
import http.server
import json
import threading

import pytest

from deltasync._library import native
from deltasync.errors import InvalidArgumentError
from deltasync.trl.vllm_server import VLLMServerEngine

REFUSED = [" 7", "7 ", "+7", "-1", "", "7x", "0x7", "\u0667", str(2**64)]


@pytest.mark.parametrize("text", REFUSED)
def test_not_plain_digits_are_refused(text):
    assert native().try_parse_decimal(text) is None
    with pytest.raises(InvalidArgumentError, match=r"^update_info version '.*': (not a decimal integer|out of range)"):
        native().parse_decimal(text, "update_info version")


def test_plain_digits_are_read():
    assert native().try_parse_decimal("7") == 7
    assert native().try_parse_decimal(str(2**64 - 1)) == 2**64 - 1
    assert native().parse_decimal("0", "v") == 0


@pytest.fixture
def weight_info_server():
    answer = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield answer, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("reported, expected", [("12", 12), ("-12", None), (" 12", None), ("broken", None), (None, None)])
def test_served_version_from_weight_info(weight_info_server, reported, expected):
    answer, url = weight_info_server
    answer["weight_version"] = reported
    assert VLLMServerEngine(url, "file:///unused").weight_version() == expected
