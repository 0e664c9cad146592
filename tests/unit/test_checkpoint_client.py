"""The S3 client of the checkpoint store (topotrain.s3client): who signs, how long it may hang.

A local HTTP server (loopback, no S3 behind it) records what the client sends:
every read here is answered 404 NoSuchKey, which the store reads as "absent".
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from botocore.exceptions import ReadTimeoutError
from topotrain.checkpoints import operator_store
from topotrain.s3client import OPERATOR_TIMEOUTS, Timeouts, make_client

NO_SUCH_KEY = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchKey</Code>"
               b"<Message>absent</Message></Error>")  # fmt: skip


class Recorder(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.headers: list[dict[str, str]] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Answer(BaseHTTPRequestHandler):
    server: Recorder

    def do_GET(self) -> None:
        self.server.headers.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(404)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(NO_SUCH_KEY)))
        self.end_headers()
        self.wfile.write(NO_SUCH_KEY)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def operator_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials in the operator's own environment, as IRSA or a mounted profile would put there."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "OPERATORKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "operator-secret")


def test_a_job_without_a_secret_is_read_unsigned(recorder: Recorder, operator_identity: None) -> None:
    store = operator_store("s3://ckpt/ns/job", recorder.endpoint, None)
    assert store.read_progress() is None
    assert recorder.headers, "no request reached the endpoint"
    for headers in recorder.headers:
        assert "authorization" not in headers
        assert not any("OPERATORKEY" in value for value in headers.values()), "signed as the operator"


def test_a_job_with_a_secret_is_signed_with_it(recorder: Recorder, operator_identity: None) -> None:
    store = operator_store("s3://ckpt/ns/job", recorder.endpoint, ("JOBKEY", "job-secret"))
    assert store.read_progress() is None
    assert all("Credential=JOBKEY/" in h["authorization"] for h in recorder.headers)


def test_the_trainer_signs_with_its_pods_environment(recorder: Recorder, operator_identity: None) -> None:
    client = make_client(recorder.endpoint)  # the trainer's store: the pod's own AWS_* variables
    with pytest.raises(client.exceptions.NoSuchKey):
        client.get_object(Bucket="ckpt", Key="progress.json")
    assert "Credential=OPERATORKEY/" in recorder.headers[0]["authorization"]


def test_a_silent_endpoint_fails_after_a_bounded_number_of_attempts() -> None:
    """The endpoint accepts connections and never answers: each attempt ends at the read timeout."""
    accepted: list[socket.socket] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)

        def accept() -> None:
            while True:
                try:
                    accepted.append(listener.accept()[0])
                except OSError:
                    return

        threading.Thread(target=accept, daemon=True).start()
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = make_client(endpoint, "k", "s", timeouts=Timeouts(connect=2.0, read=0.2, attempts=2))
        with pytest.raises(ReadTimeoutError):  # after its one retry
            client.get_object(Bucket="ckpt", Key="progress.json")
        for conn in accepted:
            conn.close()
    assert len(accepted) == 2, "one request and exactly one retry"


def test_the_operators_requests_are_bounded() -> None:
    client = operator_store("s3://ckpt/ns/job", "http://127.0.0.1:1", None).client
    config = client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (OPERATOR_TIMEOUTS.connect, OPERATOR_TIMEOUTS.read)
    assert config.retries == {"total_max_attempts": OPERATOR_TIMEOUTS.attempts, "mode": "standard"}
