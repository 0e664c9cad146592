"""The checkpoint endpoints the operator sends requests to (issue 37 item 3: a job could make
the operator send requests anywhere from its own network position).

The allowlist as a table; then the Observer (the edge that reads a job's store) with a job
naming a refused endpoint, served by a real local TCP server that counts connections: the job
gets a ConfigValid problem naming `spec.checkpoint.endpoint`, and the server sees no request.
The Kubernetes client is not needed on that path; `NoKube` stands in for it (a unit-test
boundary: it fails the test if the Observer reaches for the Secret).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.controller.endpoints import endpoint_problem
from topotrain.controller.observe import Observer
from topotrain.controller.settings import Settings

DEFAULT = "http://s3.storage.example.com:9000"


@pytest.mark.parametrize(
    ("endpoint", "extra", "allowed"),
    [
        ("http://minio.storage.svc:9000", (), True),  # an in-cluster Service
        ("https://minio.storage.svc.cluster.local", (), True),
        (DEFAULT, (), True),  # the operator's own default endpoint
        ("http://s3.storage.example.com:9001", (), False),  # same host, another port
        ("http://127.0.0.1:8080", (), False),  # the operator's own ports
        ("http://169.254.169.254/latest/meta-data", (), False),  # a cloud metadata address
        ("http://localhost:9000", (), False),
        ("http://evil.example.com.svc.attacker.net", (), False),  # ".svc" only as the suffix
        ("http://127.0.0.1:7070", ("127.0.0.1",), True),  # a host, any port
        ("http://127.0.0.1:7070", ("127.0.0.1:7071",), False),  # a host and port
        ("https://s3.eu.example.net", ("*.example.net",), True),  # a suffix
        ("https://example.net", ("*.example.net",), False),
        ("http://[::1]:9000", ("[::1]",), True),
        ("http://anything.at.all:1", ("*",), True),  # any endpoint: the old behaviour
        ("ftp://minio.storage.svc", (), False),  # not http(s)
        ("minio.storage.svc:9000", (), False),  # no scheme
    ],
)
def test_the_allowlist(endpoint: str, extra: tuple[str, ...], allowed: bool) -> None:
    problem = endpoint_problem(endpoint, DEFAULT, extra)
    assert (problem is None) is allowed, problem
    if problem is not None:
        assert problem.startswith("spec.checkpoint.endpoint ")


def test_settings_read_the_allowlist_from_the_environment() -> None:
    settings = Settings.from_env({"TOPOTRAIN_CHECKPOINT_ENDPOINTS": "127.0.0.1, *.example.net"})
    assert settings.checkpoint_endpoints == ("127.0.0.1", "*.example.net")
    assert Settings.from_env({}).checkpoint_endpoints == ()


class NoKube:
    """Stands in for the Kubernetes client: a refused endpoint must not even read the Secret."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the Observer called kube.{name} for a refused endpoint")


@pytest.fixture
def listener() -> Iterator[tuple[str, list[bytes]]]:
    """A local TCP server recording every connection's first bytes."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                seen.append(conn.recv(1024))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", seen
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_a_refused_endpoint_gets_a_condition_and_no_request(listener: tuple[str, list[bytes]]) -> None:
    endpoint, seen = listener
    spec = TrainingJobSpec.model_validate({
        "image": "trainer:1", "parallelism": {"tensor": 1, "pipeline": 1, "data": 1},
        "worker": {"gpusPerPod": 1},
        "checkpoint": {"uri": "s3://ckpt/runs", "endpoint": endpoint, "credentialsSecret": "creds"},
    })  # fmt: skip
    observer = Observer(NoKube(), Settings(), uid="u1")  # type: ignore[arg-type]
    problem, view = observer.checkpoint(("ns", "job"), spec, TrainingJobStatus(), force=True)
    assert problem is not None and problem[0] == Reason.ENDPOINT_NOT_ALLOWED
    assert problem[1].startswith(f"spec.checkpoint.endpoint '{endpoint}' is not among")
    assert view is not None and not view.reachable
    # Allowed (the admin listed loopback), the same job's store is read: the server is asked.
    allowing = Observer(NoKube(), Settings(checkpoint_endpoints=("127.0.0.1",)), uid="u1")  # type: ignore[arg-type]
    spec.checkpoint.credentials_secret = None  # type: ignore[union-attr]
    allowing.checkpoint(("ns", "job"), spec, TrainingJobStatus(), force=True)
    assert seen, "the allowed endpoint was not asked: the test cannot tell a refusal from silence"
    first = len(seen)
    observer.checkpoint(("ns", "job"), spec, TrainingJobStatus(), force=True)
    assert len(seen) == first, "a request went to a refused endpoint"
