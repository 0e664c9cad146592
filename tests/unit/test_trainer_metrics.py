"""The trainer's Prometheus endpoint: served by local rank 0, and never a reason to stop training."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
from topotrain_trainer.metrics import Metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_local_rank_0_serves_the_step_gauge() -> None:
    port = _free_port()
    metrics = Metrics(rank=0, local_rank=0, port=port)
    assert metrics.serving
    metrics.step(3, loss=1.5, grad_norm=0.1, seconds=2.0, tokens=100, log=False)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "topotrain_step 3.0" in text


def test_other_local_ranks_and_port_0_serve_nothing() -> None:
    assert not Metrics(rank=1, local_rank=1, port=_free_port()).serving
    assert not Metrics(rank=0, local_rank=0, port=0).serving


def test_a_port_still_held_costs_the_endpoint_not_the_training(capsys: pytest.CaptureFixture[str]) -> None:
    # e.g. a worker of the attempt before an in-place restart that has not let go of the port yet
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        metrics = Metrics(rank=0, local_rank=0, port=port)
    assert not metrics.serving
    warning = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert warning["event"] == "metrics_unavailable" and warning["port"] == port
    metrics.step(1, loss=1.0, grad_norm=0.1, seconds=1.0, tokens=10, log=False)  # still trains
