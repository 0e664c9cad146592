"""The operator with one resource's watch stream late (a test-boundary fake, for the soak's
replica-slow-job-watch class): `python -m testbed.chaos.slow_watch topotrain run ...` runs the
operator's command line with every event of the `TOPOTRAIN_CHAOS_WATCH_PLURAL` watch (default
`trainingjobs`) handed to kopf `TOPOTRAIN_CHAOS_WATCH_DELAY` seconds after it arrived, in order;
the other watches (pods, nodes, Workloads) are untouched. So the replica sees a job's pods
change before the job's status that changed with them: issue 37 item 1's interleaving, where a
replica decides from another replica's pod relabels and its own stale copy of the status.

The delay is a constant latency, not a slower stream: each event waits only for its own due
time, so a burst of events arrives as late as one event does. Only kopf's
`watching.infinite_watch` is wrapped (kopf's queueing module calls it through its module); the
API server, the watch connections and the operator's own code are real.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

DELAY = "TOPOTRAIN_CHAOS_WATCH_DELAY"
PLURAL = "TOPOTRAIN_CHAOS_WATCH_PLURAL"


def late(stream: AsyncIterator[Any], delay: float) -> AsyncIterator[Any]:
    """`stream`'s items, each yielded `delay` s after it arrived (an error as late, then raised)."""

    async def relay() -> AsyncIterator[Any]:
        queue: asyncio.Queue[tuple[float, Any, BaseException | None]] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for item in stream:
                    queue.put_nowait((time.monotonic() + delay, item, None))
            except Exception as ex:  # kopf's stream ends only with an unrecoverable error
                queue.put_nowait((time.monotonic() + delay, None, ex))
            else:
                queue.put_nowait((time.monotonic() + delay, None, StopAsyncIteration()))

        task = asyncio.create_task(pump())
        try:
            while True:
                due, item, error = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if isinstance(error, StopAsyncIteration):
                    return
                if error is not None:
                    raise error
                yield item
        finally:
            task.cancel()

    return relay()


def install(delay: float, plural: str) -> None:
    """Wrap kopf's watch streams: `plural`'s events arrive `delay` s late."""
    from kopf._cogs.clients import watching

    original = watching.infinite_watch

    def infinite_watch(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        stream = original(*args, **kwargs)
        resource = kwargs.get("resource")
        return late(stream, delay) if getattr(resource, "plural", None) == plural else stream

    watching.infinite_watch = infinite_watch  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    delay = float(os.environ.get(DELAY, "0"))
    if delay > 0:
        install(delay, os.environ.get(PLURAL, "trainingjobs"))
    if not argv or os.path.basename(argv[0]) != "topotrain":
        raise SystemExit(f"usage: python -m testbed.chaos.slow_watch topotrain run ... (got {argv})")
    from topotrain.cli.main import main as operator_main

    return operator_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
