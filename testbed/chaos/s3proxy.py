"""A small HTTP proxy of ours on loopback, between every S3 client of the soak
(operator, trainers) and versitygw, to make the store slow or erroring.

One request per client connection: the proxy reads the request head, adds
`Connection: close` so the server ends the exchange, then pipes both ways
until the server closes. That keeps the proxy blind to bodies (uploads,
`Expect: 100-continue`, chunked replies) while still deciding per request:

- `latency`: seconds added before the request is forwarded (S3 slow);
- `error_share`: that share of requests is answered `503 SlowDown` with an
  S3 XML error body and never reaches the server (S3 erroring);
- `tarpit`: requests naming a key prefix (in the path, or a listing's `prefix=`)
  are relayed to another port, a `testbed.tarpit.Tarpit` that trickles bytes
  (one job's checkpoint endpoint turned into a tarpit).

An outage is not simulated here: the soak stops the real server.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import unquote

HEAD_LIMIT = 64 * 1024
SLOW_DOWN = (
    b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
    b"<Message>injected by the topotrain chaos proxy</Message></Error>"
)


@dataclass
class S3Proxy:
    upstream_host: str
    upstream_port: int
    seed: int = 0
    latency: float = 0.0
    error_share: float = 0.0
    tarpit: tuple[str, int] | None = None  # (key prefix, the tarpit's port on loopback)
    requests: int = 0
    errors: int = 0
    port: int = 0
    _server: socket.socket | None = None
    _random: random.Random = field(default_factory=random.Random)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Proxy:
        self._random.seed(self.seed)
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(256)
        server.settimeout(0.5)
        self.port = server.getsockname()[1]
        self._server = server
        threading.Thread(target=self._accept, name="s3-chaos-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()

    def set(self, *, latency: float | None = None, error_share: float | None = None) -> None:
        with self._lock:
            if latency is not None:
                self.latency = latency
            if error_share is not None:
                self.error_share = error_share

    def set_tarpit(self, prefix: str | None, port: int = 0) -> None:
        """Relay requests naming keys under `prefix` to `port` (None: none any more)."""
        with self._lock:
            self.tarpit = None if prefix is None else (prefix, port)

    def _upstream_of(self, head: bytes) -> tuple[str, int]:
        with self._lock:
            tarpit = self.tarpit
        target = unquote(head.split(b"\r\n", 1)[0].decode("latin-1"))
        if tarpit is not None and tarpit[0] in target:
            return "127.0.0.1", tarpit[1]
        return self.upstream_host, self.upstream_port

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _decide(self) -> tuple[float, bool]:
        with self._lock:
            self.requests += 1
            fail = self._random.random() < self.error_share
            self.errors += fail
            return self.latency, fail

    def _serve(self, client: socket.socket) -> None:
        try:
            head, rest = _read_head(client)
            if head is None:
                return
            latency, fail = self._decide()
            if latency:
                time.sleep(latency)
            if fail:
                client.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                    b"Connection: close\r\nContent-Length: " + str(len(SLOW_DOWN)).encode()
                    + b"\r\n\r\n" + SLOW_DOWN
                )  # fmt: skip
                return
            upstream = socket.create_connection(self._upstream_of(head), timeout=30)
            with upstream:
                upstream.sendall(_close_after(head) + rest)
                done = threading.Event()
                threading.Thread(target=_pipe, args=(client, upstream, done), daemon=True).start()
                _pipe(upstream, client, done)
        except OSError:
            pass  # a client or server went away mid-exchange: the client sees a broken connection
        finally:
            client.close()


def _read_head(conn: socket.socket) -> tuple[bytes | None, bytes]:
    conn.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk or len(data) > HEAD_LIMIT:
            return None, b""
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    return head, rest


def _close_after(head: bytes) -> bytes:
    lines = [
        line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")
    ]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _pipe(source: socket.socket, sink: socket.socket, done: threading.Event) -> None:
    try:
        while not done.is_set():
            chunk = source.recv(65536)
            if not chunk:
                break
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        done.set()
        for conn in (source, sink):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
