"""The soak's late TrainingJob watch (testbed/chaos/slow_watch.py): each event handed on no
sooner than its delay after it arrived, in order, an error as late; only the named resource's
stream is wrapped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from testbed.chaos import slow_watch


async def _burst(arrived: list[float], fail: bool = False) -> AsyncIterator[int]:
    for i in range(3):
        arrived.append(time.monotonic())
        yield i
    if fail:
        raise RuntimeError("the stream broke")


def test_events_arrive_late_in_order_and_an_error_after_them() -> None:
    async def go() -> tuple[list[float], list[tuple[int, float]], BaseException | None]:
        arrived: list[float] = []
        got: list[tuple[int, float]] = []
        error = None
        try:
            async for item in slow_watch.late(_burst(arrived, fail=True), 0.2):
                got.append((item, time.monotonic()))
        except RuntimeError as ex:
            error = ex
        return arrived, got, error

    arrived, got, error = asyncio.run(go())
    assert [i for i, _ in got] == [0, 1, 2]
    assert all(at - arrived[i] >= 0.2 for i, at in got), (arrived, got)
    assert error is not None and "broke" in str(error)


def test_only_the_named_resources_watch_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    from kopf._cogs.clients import watching

    made: list[Any] = []

    def original(**kwargs: Any) -> Any:
        stream = _burst([])
        made.append(stream)
        return stream

    monkeypatch.setattr(watching, "infinite_watch", original)
    slow_watch.install(0.01, "trainingjobs")
    pods = watching.infinite_watch(resource=SimpleNamespace(plural="pods"))
    jobs = watching.infinite_watch(resource=SimpleNamespace(plural="trainingjobs"))
    assert pods is made[0] and jobs is not made[1]

    async def drain() -> list[int]:
        return [i async for i in jobs]

    assert asyncio.run(drain()) == [0, 1, 2]


def test_the_entry_runs_only_the_operators_command_line() -> None:
    with pytest.raises(SystemExit, match="usage"):
        slow_watch.main(["python", "-c", "pass"])
