"""Every API call the operator makes has a timeout: a silent API server never blocks a job's loop."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import urllib3
from kubernetes import client
from topotrain.controller import apicalls, kube


class ApiHandler(http.server.BaseHTTPRequestHandler):
    """A local HTTP server's handler standing in for the API server (the unit-test boundary)."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the API server

    def reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def serve(handler: type[ApiHandler]) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_api_server_that_never_answers_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube, "REQUEST_TIMEOUT", (1.0, 1.0))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(server.accept()[0]), daemon=True).start()
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.getsockname()[1]}"
    config.retries = 0
    api = kube.Kube(kube.TimedApiClient(config))
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.HTTPError):  # a read timeout, not a wait for ever
        api.core.read_namespaced_config_map("x-ranks", "ns")
    assert time.monotonic() - started < 20, "the call waited far beyond its timeout"
    server.close()


def test_parallel_calls_keep_their_connections_alive() -> None:
    """A gang's parallel pod calls beside the passes' calls (WORKERS + PASS_THREADS at once) reuse
    their connections on the next burst: none is dropped for a full pool and made again (on two
    cores the client's default pool held 10, and each call past it paid a TLS handshake)."""
    at_once = apicalls.WORKERS + apicalls.PASS_THREADS
    barrier = threading.Barrier(at_once, timeout=20)
    connections: list[int] = []

    class Handler(ApiHandler):
        def setup(self) -> None:
            super().setup()
            connections.append(1)

        def do_GET(self) -> None:
            barrier.wait()  # every call of the burst is in flight at once
            self.reply(200, b'{"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": "x-ranks"}}')

    server = serve(Handler)
    default = client.Configuration.get_default_copy()
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    client.Configuration.set_default(config)
    try:
        api = kube.Kube()
    finally:
        client.Configuration.set_default(default)
    with ThreadPoolExecutor(at_once) as pool:
        for _ in range(2):
            list(pool.map(lambda _: api.core.read_namespaced_config_map("x-ranks", "ns"), range(at_once)))
    server.shutdown()
    assert len(connections) == at_once, f"{len(connections) - at_once} connections made again"


def test_a_busy_api_servers_answer_to_a_pod_create_is_tried_again_a_refusal_is_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gang's create that meets a busy API server (a 500 from an etcd timeout, a 429, a 504) is
    tried again: counted as refused, it would take back every pod the gang had created (a
    1,024-pod gang at 5,000 nodes started over, gated, 40 s later). A real refusal (422, an
    invalid pod) is not tried again. The API server is a local HTTP server at this unit boundary."""
    monkeypatch.setattr(apicalls, "CREATE_RETRY_SECONDS", 0.01)
    answers = {"busy": [500, 201], "slow": [504, 429, 201], "bad": [422, 201], "down": [503, 503, 503, 201]}
    posts: list[str] = []

    class Handler(ApiHandler):
        def do_POST(self) -> None:
            pod = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            name = pod["metadata"]["name"]
            posts.append(name)
            code = answers[name].pop(0)
            self.reply(code, json.dumps(pod if code == 201 else {"kind": "Status", "apiVersion": "v1", "code": code,
                                                                 "message": f"answer {code}"}).encode())

    server = serve(Handler)
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    api = kube.Kube(kube.TimedApiClient(config))
    manifests = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns"},
                  "spec": {"containers": [{"name": "c", "image": "i"}]}} for name in answers]
    created, refused = api.create_pods(manifests)
    server.shutdown()
    assert sorted(created) == ["busy", "slow"]
    assert refused == {"bad": "422: answer 422", "down": "503: answer 503"}  # down: out of tries
    assert sorted(posts) == sorted(["busy"] * 2 + ["slow"] * 3 + ["bad"] + ["down"] * apicalls.CREATE_TRIES)
