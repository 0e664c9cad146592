"""The chaos soak's S3 proxy on loopback: passes requests through, adds latency, answers
503 SlowDown to a share of requests (against a tiny local HTTP server, no S3 needed)."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from testbed.chaos.s3proxy import S3Proxy


class Echo(BaseHTTPRequestHandler):
    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[S3Proxy]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    chaos = S3Proxy("127.0.0.1", server.server_address[1], seed=1).start()
    yield chaos
    chaos.stop()
    server.shutdown()


def put(proxy: S3Proxy, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{proxy.endpoint}/bucket/key", data=body, method="PUT")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_requests_and_bodies_pass_through(proxy: S3Proxy) -> None:
    body = bytes(range(256)) * 4000  # larger than one read
    assert put(proxy, body) == (200, body)


def test_latency_is_added_per_request(proxy: S3Proxy) -> None:
    proxy.set(latency=0.3)
    started = time.monotonic()
    assert put(proxy, b"x")[0] == 200
    assert time.monotonic() - started >= 0.3


def test_a_share_of_requests_gets_slow_down(proxy: S3Proxy) -> None:
    proxy.set(error_share=1.0)
    status, body = put(proxy, b"x")
    assert status == 503 and b"<Code>SlowDown</Code>" in body
    proxy.set(error_share=0.5)
    codes = [put(proxy, b"x")[0] for _ in range(40)]
    assert 5 < codes.count(503) < 35 and set(codes) == {200, 503}
    assert proxy.errors == 1 + codes.count(503) and proxy.requests == 41


def test_one_prefix_is_relayed_to_a_tarpit_and_the_rest_passes(proxy: S3Proxy) -> None:
    """checkpoint-tarpit: one job's keys (in the path or a listing's prefix) trickle; others do not."""
    from testbed.tarpit import Tarpit

    with Tarpit(interval=0.2) as tarpit:
        proxy.set_tarpit("jobs/ns/slow/", int(tarpit.url.rsplit(":", 1)[1]))
        for target in ("/bucket/jobs/ns/slow/step-1/COMMITTED", "/bucket?list-type=2&prefix=jobs%2Fns%2Fslow%2F"):
            request = urllib.request.Request(f"{proxy.endpoint}{target}", data=b"x", method="PUT")
            with urllib.request.urlopen(request, timeout=5) as reply:
                assert reply.status == 200 and reply.read(3) == b"   "  # a byte at a time, never the end
        assert put(proxy, b"other job") == (200, b"other job")
        proxy.set_tarpit(None)
        request = urllib.request.Request(f"{proxy.endpoint}/bucket/jobs/ns/slow/x", data=b"back", method="PUT")
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.read() == b"back"
