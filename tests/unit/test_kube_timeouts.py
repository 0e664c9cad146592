"""Every API call the operator makes has a timeout: a silent API server never blocks a job's loop."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import urllib3
from kubernetes import client
from topotrain import kube


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
