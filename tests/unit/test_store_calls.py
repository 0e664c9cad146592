"""One namespace's slow checkpoint store stalls nothing but that namespace (issue 37 item 3).

Two real HTTP servers on loopback, run by threads of this test: a tarpit (testbed/tarpit.py)
that answers every request with headers and then one byte every half second (botocore's read timeout, per socket
read, never fires), and a minimal S3 that holds an empty bucket. The operator's Observer reads
a job's store through boto3 against each, through `StoreCalls` (the bounded pool, per-namespace
cap and per-read deadline). The Kubernetes client is not needed (no credentials Secret, no
ownership claim); `NoKube` stands in for it, a unit-test boundary.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import TrainingJobStatus
from topotrain.controller.observe import Observer
from topotrain.controller.settings import Settings
from topotrain.controller.storecalls import StoreCalls

from testbed.tarpit import Tarpit

# Long enough that the working store's read ends inside it on a starved machine (CI, 2026-12-06:
# at 6 s, beside the kind stage and the Kueue suite, that read itself ran out of time).
DEADLINE = 10.0
LOOPBACK = Settings(checkpoint_endpoints=("127.0.0.1",))


class NoKube:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"kube.{name} called")


class EmptyS3(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if "list-type=2" in self.path:
            body = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
                    b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>ckpt</Name>'
                    b"<KeyCount>0</KeyCount><IsTruncated>false</IsTruncated></ListBucketResult>")
            self.send_response(200)
        else:
            body = b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>"
            self.send_response(404)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def tarpit() -> Iterator[str]:
    with Tarpit() as server:  # stopping it ends every trickle: the stuck reads free their threads
        yield server.url


@pytest.fixture
def empty_s3() -> Iterator[str]:
    yield from serve(EmptyS3)


def job(endpoint: str) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "trainer:1", "parallelism": {"tensor": 1, "pipeline": 1, "data": 1},
        "worker": {"gpusPerPod": 1}, "checkpoint": {"uri": "s3://ckpt/runs", "endpoint": endpoint},
    })  # fmt: skip


def test_a_tarpit_store_ends_by_the_deadline_and_other_namespaces_proceed(
    tarpit: str, empty_s3: str
) -> None:
    calls = StoreCalls(threads=8, per_namespace=2, deadline=DEADLINE)
    slow = [Observer(NoKube(), LOOPBACK) for _ in range(4)]  # type: ignore[arg-type]
    fast = Observer(NoKube(), LOOPBACK)  # type: ignore[arg-type]
    status = TrainingJobStatus()

    fast.checkpoint(("b", "ok"), job(empty_s3), status, True)  # botocore's models loaded once

    async def scenario() -> None:
        began = time.monotonic()
        # four jobs of namespace "a" point at the tarpit, one job of "b" at a working store
        stuck = [asyncio.create_task(calls.checkpoint(o, ("a", f"j{i}"), job(tarpit), status, True))
                 for i, o in enumerate(slow)]  # fmt: skip
        await asyncio.sleep(0.3)
        assert calls.running("a") == 2, "namespace a holds more than its two threads"
        problem, view = await calls.checkpoint(fast, ("b", "ok"), job(empty_s3), status, True)
        assert problem is None and view is not None and view.reachable and view.step is None
        # b's read was served while a's four reads were still held (they end only by the deadline)
        assert not any(task.done() for task in stuck), "namespace b waited behind namespace a"
        for task in stuck:
            problem, view = await task
            assert view is not None and not view.reachable
            assert f"within {DEADLINE:.0f}s" in view.error, view.error
        # each read ended by its deadline (they were asked together, the two queued ones too):
        # the tarpit's trickle never lets a socket timeout fire, so without the deadline they
        # would not end at all (a loose bound: a loaded machine wakes threads late)
        assert time.monotonic() - began < 2 * DEADLINE
        assert calls.running("a") == 2  # the two reads stuck in botocore keep their slots

    asyncio.run(scenario())
    calls.close()


def test_a_read_past_its_deadline_frees_its_slot_once_it_ends() -> None:
    calls = StoreCalls(threads=2, per_namespace=1, deadline=0.5)

    def slow_then_done() -> str:
        time.sleep(1.0)
        return "done"

    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await calls.run("a", slow_then_done)
        assert calls.running("a") == 1
        # the read ends 0.5 s later and frees its slot (polled: a loaded machine wakes threads late)
        for _ in range(200):
            if calls.running("a") == 0:
                break
            await asyncio.sleep(0.05)
        assert calls.running("a") == 0
        assert await calls.run("a", lambda: "next") == "next"

    asyncio.run(scenario())
    calls.close()

