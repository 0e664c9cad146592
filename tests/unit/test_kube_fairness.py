"""One gang's many API calls take turns with other jobs' on the operator's shared pool of API
workers (`apicalls.bounded_map`, which `Kube`'s pod calls go through): a job that arrives while a 1,024-pod gang is created gets its own pods
created at once, not after the whole gang's. The API server is faked at this unit boundary (the
calls are functions that wait a little)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from topotrain.controller.apicalls import PER_GANG, WORKERS, bounded_map


def test_a_small_jobs_calls_are_not_queued_behind_a_big_gangs() -> None:
    pool = ThreadPoolExecutor(WORKERS)  # the operator's shared pool (Kube.pool)
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
        result.extend(bounded_map(pool, call, big))

    thread = threading.Thread(target=big_gang)
    thread.start()
    started.wait()
    deadline = time.monotonic() + 60
    while not done:  # the gang's calls are under way
        assert thread.is_alive() and time.monotonic() < deadline, "the gang's calls never ran"
        time.sleep(0.001)
    assert bounded_map(pool, call, ["small-0", "small-1"]) == ["small-0", "small-1"]
    with lock:
        before = sum(1 for name in done if name.startswith("big-"))
    thread.join()
    # The small job did not wait for the rest of the gang (the shared pool serves in arrival
    # order: unbounded, all 400 went first). How many of the gang's calls finish meanwhile
    # depends on the machine's load (its calls keep running beside the small job's, on the
    # workers it may hold): test_a_small_jobs_calls_run_while_a_big_gangs_calls_hang shows
    # without timing that the small job's calls need none of them to finish.
    assert before <= len(big) // 2, f"{before} of the gang's calls went first"
    assert result == big  # the gang's answers in its own order, all of them
    pool.shutdown()


def test_the_first_failure_is_raised_after_every_call_ran() -> None:
    pool = ThreadPoolExecutor(WORKERS)
    ran: list[int] = []

    def call(i: int) -> int:
        ran.append(i)
        if i == 3:
            raise ValueError("refused")
        return i

    with pytest.raises(ValueError, match="refused"):
        bounded_map(pool, call, list(range(40)))
    assert sorted(ran) == list(range(40))
    pool.shutdown()


def test_a_small_jobs_calls_run_while_a_big_gangs_calls_hang() -> None:
    """The gang may hold PER_GANG of the pool's workers, never all: with every one of its calls
    stuck on a slow API server, another job's pod calls still run at once, on the workers left."""
    assert PER_GANG < WORKERS
    pool = ThreadPoolExecutor(WORKERS)
    go = threading.Event()
    in_flight = threading.Semaphore(0)

    def slow(i: int) -> int:
        in_flight.release()
        assert go.wait(30)
        return i

    gang = threading.Thread(target=bounded_map, args=(pool, slow, list(range(100))))
    gang.start()
    for _ in range(PER_GANG):  # the gang's calls hold their workers
        assert in_flight.acquire(timeout=10)
    small = ThreadPoolExecutor(1).submit(bounded_map, pool, lambda name: name, ["small-0", "small-1"])
    try:
        assert small.result(timeout=10) == ["small-0", "small-1"]
    finally:
        go.set()
        gang.join()
        pool.shutdown()
