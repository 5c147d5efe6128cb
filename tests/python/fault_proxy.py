"""A fault-injecting HTTP proxy on loopback for the store tests.

It forwards every request unchanged (including the Host header, which SigV4 signs) to one
upstream server and answers with the upstream's response, unless a queued fault matches the
request. Faults are consumed in order, each for `times` matching requests:

  status     answer with this HTTP status (and an S3-style error body whose <Code> is `code`)
             without forwarding
  drop       forward, then send the response headers and only part of the body, and close
  delay      wait `seconds` before answering (a slow or stalled server)
  stall      forward, send headers and the first bytes of the body, then stall `seconds`
  redirect   answer 307 with `location` (a URL; may point to another host)
  hang_put   accept the request body, then never answer (until the client goes away); sets
             `hit` so a test can act (e.g. kill the client) mid-upload
  gate       wait until `event` (a threading.Event) is set, then forward: uploads stalled
             until the test lets them go (the wait ends by itself after `seconds`, default 30,
             so a regression fails its assertions instead of hanging)
"""
import http.client
import http.server
import socketserver
import threading
import time


def forward(upstream, method, path, request_headers, body):
    """Sends the request unchanged (Host included: SigV4 signs it) to upstream=(host, port);
    returns (status, headers to pass on, body)."""
    conn = http.client.HTTPConnection(*upstream, timeout=60)
    headers = {k: v for k, v in request_headers.items() if k.lower() not in ("expect", "connection")}
    conn.request(method, path, body=body if body else None, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "connection", "content-length")]
    conn.close()
    return resp.status, out_headers, data


class ThreadingServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive, no request log, and whole responses in one call."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_all(self, status, headers, data, body_bytes=None):
        """body_bytes: send only that much of the body (a connection dropped mid-body)."""
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data if body_bytes is None else data[:body_bytes])
            self.wfile.flush()

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def drop_connection(self):
        """Closes the connection now (a cut; or the end of a body sent part-way)."""
        self.close_connection = True
        try:
            self.connection.shutdown(2)
        except OSError:
            pass


class Fault:
    def __init__(self, kind, times=1, method=None, path_contains=None, **params):
        self.kind, self.times, self.method, self.path_contains, self.params = kind, times, method, path_contains, params
        self.hit = threading.Event()

    def matches(self, method, path):
        return (self.method is None or self.method == method) and (self.path_contains is None or self.path_contains in path)


class FaultProxy:
    def __init__(self, upstream_host, upstream_port):
        self.upstream = (upstream_host, upstream_port)
        self.faults = []
        self.lock = threading.Lock()
        self.requests = []  # (method, path) of every request seen
        # (method, path, If-None-Match or If-Match sent, status, body bytes) of every request passed
        # on without a fault
        self.answers = []
        proxy = self

        class Handler(QuietHandler):
            _send = QuietHandler.send_all

            def _take_fault(self):
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                    for fault in proxy.faults:
                        if fault.times > 0 and fault.matches(self.command, self.path):
                            fault.times -= 1
                            return fault
                return None

            def _forward(self, body):
                return forward(proxy.upstream, self.command, self.path, self.headers, body)

            def _handle(self):
                fault = self._take_fault()
                body = self.read_body()
                if fault:
                    fault.hit.set()
                    kind, p = fault.kind, fault.params
                    if kind == "status":
                        code = p.get("status", 503)
                        error_code = p.get("code", f"Injected{code}")
                        xml = (f"<?xml version=\"1.0\"?><Error><Code>{error_code}</Code>"
                               f"<Message>injected by fault_proxy</Message></Error>").encode()
                        self._send(code, [("Content-Type", "application/xml")], xml)
                        return
                    if kind == "redirect":
                        self._send(307, [("Location", p["location"])], b"")
                        return
                    if kind == "delay":
                        time.sleep(p.get("seconds", 1.0))
                    if kind == "gate":
                        p["event"].wait(p.get("seconds", 30.0))
                    if kind == "hang_put":
                        time.sleep(p.get("seconds", 60))
                        self.close_connection = True
                        return
                    status, headers, data = self._forward(body)
                    if kind == "drop" and self.command != "HEAD" and len(data) > 1:
                        self._send(status, headers, data, body_bytes=len(data) // 2)
                        self.drop_connection()
                        return
                    if kind == "stall" and self.command != "HEAD" and len(data) > 1:
                        self._send(status, headers, data, body_bytes=1)
                        time.sleep(p.get("seconds", 5))
                        self.close_connection = True
                        return
                    self._send(status, headers, data)
                    return
                status, headers, data = self._forward(body)
                with proxy.lock:
                    conditional = self.headers.get("If-None-Match") or self.headers.get("If-Match")
                    proxy.answers.append((self.command, self.path, conditional, status, len(data)))
                self._send(status, headers, data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, kind, times=1, method=None, path_contains=None, **params):
        fault = Fault(kind, times, method, path_contains, **params)
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear(self):
        with self.lock:
            self.faults.clear()
            self.requests.clear()
            self.answers.clear()

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
