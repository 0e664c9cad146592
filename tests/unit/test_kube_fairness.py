"""One gang's many API calls take turns with other jobs' on the operator's shared pool of API
workers (`Kube.map`): a job that arrives while a 1,024-pod gang is created gets its own pods
created at once, not after the whole gang's. The API server is faked at this unit boundary (the
calls are functions that wait a little)."""

from __future__ import annotations

import threading
import time

import pytest
from kubernetes import client
from topotrain.controller.kube import PER_GANG, WORKERS, Kube


def test_a_small_jobs_calls_are_not_queued_behind_a_big_gangs() -> None:
    kube = Kube(client.ApiClient())
    done: list[str] = []
    lock = threading.Lock()

    def call(name: str) -> str:
        time.sleep(0.01)  # one API call
        with lock:
            done.append(name)
        return name

    big = [f"big-{i}" for i in range(400)]
    started = threading.Event()
    result: list[str] = []

    def big_gang() -> None:
        started.set()
        result.extend(kube.map(call, big))

    thread = threading.Thread(target=big_gang)
    thread.start()
    started.wait()
    while not done:  # the gang's calls are under way
        time.sleep(0.001)
    assert kube.map(call, ["small-0", "small-1"]) == ["small-0", "small-1"]
    with lock:
        before = sum(1 for name in done if name.startswith("big-"))
    thread.join()
    # The small job waited for at most the gang's calls already queued or running (PER_GANG),
    # not for the rest of the gang (the shared pool serves in arrival order).
    assert before <= PER_GANG + WORKERS + 2, f"{before} of the gang's calls went first"
    assert result == big  # the gang's answers in its own order, all of them
    kube.pool.shutdown()


def test_the_first_failure_is_raised_after_every_call_ran() -> None:
    kube = Kube(client.ApiClient())
    ran: list[int] = []

    def call(i: int) -> int:
        ran.append(i)
        if i == 3:
            raise ValueError("refused")
        return i

    with pytest.raises(ValueError, match="refused"):
        kube.map(call, list(range(40)))
    assert sorted(ran) == list(range(40))
    kube.pool.shutdown()
