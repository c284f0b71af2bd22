"""A real S3 API server on 127.0.0.1 (moto's server mode) behind a proxy that fails requests on demand.

``S3WithFaults`` starts ``moto.server.ThreadedMotoServer`` and a small HTTP proxy in front of it; clients
(s3fs through ``endpoint_url``) talk to the proxy. The proxy forwards every request unchanged, except
those its fault plan picks, as a flaky network or an overloaded endpoint fails them:

- request classes (``Fault.method``): ``upload`` (PUT/POST), ``read`` (GET of an object, HEAD),
  ``list`` (GET of a bucket: a listing);
- kinds (``Fault.kind``): ``500`` (``InternalError``), ``503`` (``SlowDown``: S3's throttling answer),
  ``cut`` (the connection closed without an answer; an upload's half-way through its body).
"""

import http.client
import http.server
import random
import socket
import threading
from collections import Counter
from dataclasses import dataclass

from _runs import free_port
from moto.server import ThreadedMotoServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


_ERRORS = {
    "500": (500, b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"),
    "503": (503, b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"),
}


@dataclass
class Fault:
    """Fail requests of class ``method`` (``upload``, ``read``, ``list``) with ``kind`` (``500``, ``503``,
    ``cut``): the next ``times`` matching ones, or every one while it is planned (``times=None``: a fault
    that persists). ``match``: only requests whose path contains this string."""

    method: str
    kind: str
    times: int | None = None
    match: str | None = None

    def __post_init__(self):
        if self.method not in ("upload", "read", "list") or self.kind not in ("500", "503", "cut"):
            raise ValueError(f"Fault: unknown method {self.method!r} or kind {self.kind!r}")


def request_class(method: str, path: str) -> str:
    """``upload``, ``list`` or ``read`` for an S3 request (path-style addressing: ``/bucket/key?query``)."""
    if method in ("PUT", "POST"):
        return "upload"
    target = path.split("?", 1)[0].strip("/")
    return "list" if method == "GET" and "/" not in target else "read"


class _Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: "S3WithFaults"

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self):
        fault = self.owner.pick_fault(self.command, self.path)
        if fault == "cut":  # read part of an upload, then drop the connection without an answer
            if self.command in ("PUT", "POST"):
                self.rfile.read(max(1, int(self.headers.get("Content-Length") or 2) // 2))
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        body = self._read_body()
        if fault in _ERRORS:
            status, payload = _ERRORS[fault]
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":  # a HEAD answer has no body (S3 sends only the status)
                self.wfile.write(payload)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        conn = http.client.HTTPConnection("127.0.0.1", self.owner.moto_port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", length or "0")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def log_message(self, *args):
        pass


class S3WithFaults:
    """moto S3 on 127.0.0.1 plus a fault-injecting proxy; ``endpoint_url`` is the proxy's.

    Faults (all off by default): ``fail_rate`` — each upload fails with this probability (seeded),
    half of them with a 500, half with a connection cut mid-body; ``block`` — every upload whose path
    contains this string fails with a 500; ``plan`` — a list of ``Fault`` (the first that matches a
    request serves it). ``injected`` counts the faults served by kind, ``injected_by`` by (class, kind).
    """

    def __init__(self, *, seed: int = 0):
        self.moto_port, self.proxy_port = free_port(), free_port()
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        handler = type("Proxy", (_Proxy,), {"owner": self})
        self.proxy = http.server.ThreadingHTTPServer(("127.0.0.1", self.proxy_port), handler)
        self.proxy.daemon_threads = True
        self.fail_rate = 0.0
        self.block: str | None = None
        self.injected = {"500": 0, "503": 0, "cut": 0}
        self.injected_by: Counter = Counter()
        self.plan: list[Fault] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def pick_fault(self, method: str, path: str) -> str | None:
        """The fault to serve for this request, or None to forward it."""
        what = request_class(method, path)
        with self._lock:
            fault = self._planned_locked(what, path)
            if fault is None and what == "upload":
                if self.block is not None and self.block in path:
                    fault = "500"
                elif self.fail_rate and self._rng.random() < self.fail_rate:
                    fault = self._rng.choice(["500", "cut"])
            if fault is not None:
                self.injected[fault] += 1
                self.injected_by[what, fault] += 1
            return fault

    def _planned_locked(self, what: str, path: str) -> str | None:
        for f in self.plan:
            if f.method == what and (f.match is None or f.match in path) and f.times != 0:
                if f.times is not None:
                    f.times -= 1
                return f.kind
        return None

    def __enter__(self) -> "S3WithFaults":
        self.moto.start()
        threading.Thread(target=self.proxy.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()
        self.moto.stop()
