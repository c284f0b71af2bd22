"""A real S3 API server on 127.0.0.1 (moto's server mode) behind a proxy that fails uploads on demand.

``S3WithFaults`` starts ``moto.server.ThreadedMotoServer`` and a small HTTP proxy in front of it; clients
(s3fs through ``endpoint_url``) talk to the proxy. The proxy forwards every request unchanged, except
uploads (PUT/POST) that its fault plan picks: those get a 500 ``InternalError`` or have their connection
cut half-way through the body (no response at all), as a flaky network or an overloaded endpoint does.
"""

import http.client
import http.server
import random
import socket
import threading

from moto.server import ThreadedMotoServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        if fault == "cut":  # read part of the upload, then drop the connection without an answer
            self.rfile.read(max(1, int(self.headers.get("Content-Length") or 2) // 2))
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        body = self._read_body()
        if fault == "500":
            payload = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
            self.send_response(500)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
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

    Faults (both off by default): ``fail_rate`` — each upload fails with this probability (seeded),
    half of them with a 500, half with a connection cut mid-body; ``block`` — every upload whose path
    contains this string fails with a 500. ``injected`` counts the faults served.
    """

    def __init__(self, *, seed: int = 0):
        self.moto_port, self.proxy_port = _free_port(), _free_port()
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        handler = type("Proxy", (_Proxy,), {"owner": self})
        self.proxy = http.server.ThreadingHTTPServer(("127.0.0.1", self.proxy_port), handler)
        self.proxy.daemon_threads = True
        self.fail_rate = 0.0
        self.block: str | None = None
        self.injected = {"500": 0, "cut": 0}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def pick_fault(self, method: str, path: str) -> str | None:
        if method not in ("PUT", "POST"):
            return None
        with self._lock:
            if self.block is not None and self.block in path:
                fault = "500"
            elif self.fail_rate and self._rng.random() < self.fail_rate:
                fault = self._rng.choice(["500", "cut"])
            else:
                return None
            self.injected[fault] += 1
            return fault

    def __enter__(self) -> "S3WithFaults":
        self.moto.start()
        threading.Thread(target=self.proxy.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()
        self.moto.stop()
