"""A local stand-in for the Hugging Face bucket S3 gateway, for the store tests.

The gateway (127.0.0.1) forwards every request, signature included, to the signature-checking
moto server and enforces the gateway's rules that moto does not: no x-amz-meta-* headers, no
aws-chunked bodies, ListObjectsV2 only and "/" as the only delimiter. A successful GetObject is
not answered with the bytes but, as the real gateway does for clients other than the AWS CLI,
botocore and the Rust SDK, with 302 to a "CDN" on a second loopback address (127.0.0.2) whose URL
carries a pre-signed query. The CDN serves the stashed response and records the headers of
every request it receives, so a test can check that no credential ever reached it.

redirect_every_get=True is the stricter gateway: every object GET is answered by the redirect,
whatever the object store said (404, 304, 412 included), and the CDN answers with ETags of its
own, so a client that takes its compare-and-swap tag from a GET is caught.
"""
import secrets
import threading
import urllib.parse

from fault_proxy import QuietHandler, ThreadingServer, forward

SIGNATURE_MARK = "CDN-PRESIGNED-SIGNATURE-0123456789"


class GatewayEmulator:
    def __init__(self, upstream_host, upstream_port, cdn_host="127.0.0.2", redirect_base=None, redirect_every_get=False):
        """redirect_base: where redirects point (default: the local CDN); a test may point them at a
        host that must be refused (e.g. plain HTTP off loopback)."""
        self.upstream = (upstream_host, upstream_port)
        self.stash = {}  # token -> (status, headers, body)
        self.cdn_requests = []  # (method, path, {header: value}) as the CDN received them
        self.gateway_requests = []  # (method, path, {header: value})
        self.refused = []  # (method, path, reason) of requests the gateway rules refused
        self.lock = threading.Lock()
        emulator = self

        class Gateway(QuietHandler):
            _send = QuietHandler.send_all

            def _refuse(self, reason):
                with emulator.lock:
                    emulator.refused.append((self.command, self.path, reason))
                xml = f"<?xml version=\"1.0\"?><Error><Code>InvalidRequest</Code><Message>{reason}</Message></Error>"
                self._send(400, [("Content-Type", "application/xml")], xml.encode())

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with emulator.lock:
                    emulator.gateway_requests.append((self.command, self.path, dict(self.headers.items())))
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query, keep_blank_values=True)
                if any(k.lower().startswith("x-amz-meta-") for k in self.headers.keys()):
                    return self._refuse("x-amz-meta-* headers are not supported")
                if "STREAMING" in (self.headers.get("x-amz-content-sha256") or ""):
                    return self._refuse("aws-chunked uploads are not supported")
                if self.command == "GET" and "prefix" in query and query.get("list-type") != ["2"]:
                    return self._refuse("only ListObjectsV2 is supported")
                if "delimiter" in query and query["delimiter"] != ["/"]:
                    return self._refuse("only '/' is supported as a delimiter")
                status, out, data = forward(emulator.upstream, self.command, self.path, self.headers, body)
                is_object_get = self.command == "GET" and "list-type" not in query and "uploadId" not in query
                if is_object_get and (status in (200, 206) or redirect_every_get):
                    if redirect_every_get:  # the CDN's tags are not the gateway's
                        out = [(k, f'"cdn-{secrets.token_hex(6)}"' if k.lower() == "etag" else v) for k, v in out]
                    token = secrets.token_hex(8)
                    with emulator.lock:
                        emulator.stash[token] = (status, out, data)
                    base = redirect_base or emulator.cdn_url
                    location = f"{base}/cdn/{token}?X-Amz-Expires=60&X-Amz-Signature={SIGNATURE_MARK}"
                    return self._send(302, [("Location", location)], b"")
                self._send(status, out, data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Cdn(QuietHandler):
            def do_GET(self):
                with emulator.lock:
                    emulator.cdn_requests.append((self.command, self.path, dict(self.headers.items())))
                parts = urllib.parse.urlsplit(self.path)
                token = parts.path.rsplit("/", 1)[-1]
                signed = urllib.parse.parse_qs(parts.query).get("X-Amz-Signature") == [SIGNATURE_MARK]
                with emulator.lock:
                    stashed = emulator.stash.get(token)
                if not signed or stashed is None:
                    return self.send_all(403, [], b"")
                self.send_all(*stashed)

        self.gateway = ThreadingServer(("127.0.0.1", 0), Gateway)
        self.cdn = ThreadingServer((cdn_host, 0), Cdn)
        self.url = f"http://127.0.0.1:{self.gateway.server_address[1]}"
        self.cdn_url = f"http://{cdn_host}:{self.cdn.server_address[1]}"
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self.gateway, self.cdn)]

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def stop(self):
        for s in (self.gateway, self.cdn):
            s.shutdown()
            s.server_close()
