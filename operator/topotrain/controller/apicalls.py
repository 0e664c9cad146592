"""How the operator's API calls are run and read, without the client itself (kube.py is the only
module that imports it): the shared pool's size and its per-gang bound, the raw answers of pod
writes drained, the API server's own words from an error."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from typing import Any, TypeVar

T = TypeVar("T")
WORKERS = 24  # parallel pod creates/deletes: a 512-pod gang in well under a second
# The most calls one gang's creates (or releases, deletes, patches) have queued or in flight on
# the shared pool at once: two-thirds of its workers, so a gang alone keeps 16 calls in flight,
# while another job's calls find workers free rather than waiting behind the gang's (the pool
# serves in arrival order: a 1,024-pod gang used to queue its 2,048 calls ahead of everyone's;
# with every worker the gang's, a job arriving during a 1,024-pod start waited behind 16 of its
# calls for each of its own, and its pass went over a second).
PER_GANG = 16
# A pod create the API server answers with one of these (too busy, a timeout of its own, etcd
# slow to answer) is tried again before it counts as refused: a refusal takes back the whole
# gang's created pods, and one busy moment must not cost a 1,024-pod gang its start.
TRANSIENT = frozenset({429, 500, 502, 503, 504})
CREATE_TRIES = 3
CREATE_RETRY_SECONDS = 1.0
PASS_THREADS = 16  # the event loop's worker threads (main.py): the passes' blocking calls
# Connections kept alive to the API server: one for each thread that may call at once. (The
# client's default, 5 per CPU, is 10 on two cores: a gang's 16 parallel creates beside the passes'
# calls found the pool full, and each call past it paid a TLS handshake on a busy API server.)
CONNECTIONS = WORKERS + PASS_THREADS


def bounded_map(pool: Executor, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
    """`fn` over `items` on `pool`, in order, with at most PER_GANG of them queued or running at
    once, so that one gang's calls take turns with other jobs' instead of all coming first.
    Raises the first item's error, as `Executor.map` does, once all are done."""
    slots = threading.BoundedSemaphore(PER_GANG)
    futures: list[Future[T]] = []
    for item in items:
        slots.acquire()
        future = pool.submit(fn, item)
        future.add_done_callback(lambda _: slots.release())
        futures.append(future)
    wait(futures)
    return [f.result() for f in futures]


def drain(response: Any) -> None:
    """Read a raw (`_preload_content=False`) answer to its end and hand its connection back.

    The operator's pod writes need only their status (an error still raises ApiException, with
    the API server's message): decoding the returned Pod into the client's model classes cost
    about a millisecond of CPU a call, 2,048 of them for a 1,024-pod gang's create and release."""
    response.read()
    response.release_conn()


def api_message(exc: Any) -> str:
    """The API server's own words from an error response (its Status message), else the reason."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return str(message or exc.reason or "unknown error")[:1000]
