"""A tiny threaded HTTP proxy in front of a loopback S3 endpoint that injects faults.

Clients point ``endpoint_url`` at :attr:`FaultProxy.url`; every request is forwarded to the
upstream (a moto server) unless :attr:`FaultProxy.rule` says otherwise for it:

- ``"500"``: answer ``500 InternalError``;
- ``"503"``: answer ``503 SlowDown`` (S3's throttling reply);
- ``"501"``: answer ``501 NotImplemented`` (a store without a feature the request asks for,
  such as conditional writes);
- ``"409"``: answer ``409 ConditionalRequestConflict`` (a conditional put racing another write
  of the key); ``"404"``: answer ``404 NoSuchKey`` (the object a put's ``If-Match`` names is gone);
- ``"reset"``: drop the connection with a TCP reset, without answering;
- ``"hang"``: never answer (until :meth:`FaultProxy.close`), as a stalled endpoint does.
- ``"late"``: forward the request only after :attr:`FaultProxy.late_s` seconds: it lands on
  the store after the client's read timeout, as a request whose reply S3 is slow to send.

Written by hand: toxiproxy needs its own server binary and speaks TCP, not per-request HTTP
faults; mitmproxy is a large dependency for ~100 lines.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

#: Error actions: the S3 error code each answers with (its HTTP status is the action).
_ERRORS = {"500": "InternalError", "503": "SlowDown", "501": "NotImplemented",
           "409": "ConditionalRequestConflict", "404": "NoSuchKey"}

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


@dataclass(frozen=True)
class Request:
    """One request as the proxy saw it."""

    method: str
    path: str  # with the query string
    action: str | None


class FaultProxy:
    """See the module doc. Attributes: ``rule(method, path) -> action | None`` (a rule with an
    attribute ``headers = True`` is called with the request's headers too), ``requests``."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rule: Callable[[str, str], str | None] | None = None
        self.requests: list[Request] = []
        self.late_s = 5.0
        self.landed_late = 0  # "late" requests forwarded so far
        self._lock = threading.Lock()
        self._closing = threading.Event()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def decide(self, method: str, path: str, headers: object = None) -> str | None:
        with self._lock:
            rule = self.rule
            if rule is None:
                action = None
            elif getattr(rule, "headers", False):
                action = rule(method, path, headers)  # type: ignore[call-arg]
            else:
                action = rule(method, path)
            self.requests.append(Request(method, path, action))
            return action

    def count(self, action: str) -> int:
        with self._lock:
            return sum(r.action == action for r in self.requests)

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _error(self, status: int, code: str) -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>injected {code}</Message><RequestId>gockpt</RequestId></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        body = self._body()
        action = self.owner.decide(self.command, self.path, self.headers)
        if action in _ERRORS:
            self._error(int(action), _ERRORS[action])
            return
        if action == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if action == "hang":
            self.owner._closing.wait(120)
            self.close_connection = True
            return
        if action == "late" and self.owner._closing.wait(self.owner.late_s):
            self.close_connection = True  # closed meanwhile: dropped
            return
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status, resp.reason)
            for key, value in resp.getheaders():
                if key.lower() not in _HOP and key.lower() != "content-length":
                    self.send_header(key, value)
            length = resp.getheader("Content-Length") if self.command == "HEAD" else len(data)
            self.send_header("Content-Length", str(length or 0))
            self.end_headers()
            if action == "late":
                with self.owner._lock:
                    self.owner.landed_late += 1
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
