"""Checkpoint-store reads, kept from stalling anything but their own namespace.

A job's checkpoint endpoint is the user's: it may answer slowly, or trickle bytes so that
botocore's timeout (per socket read) never fires. These reads used to share the pass pool
with every job's API calls, so sixteen such jobs held every thread and stopped failure
recovery and hang detection cluster-wide. Now:

- they run in a pool of their own (STORE_THREADS), apart from the API calls and status
  writes of every pass;
- at most PER_NAMESPACE of them run at once for one namespace, counted until the thread is
  really free (a read stuck on a tarpit keeps its slot), so one namespace can hold at most
  that many of the pool's threads however many jobs it has;
- each read has a wall-clock deadline (DEADLINE_SECONDS) from the moment it is asked,
  waiting for a slot included: past it the pass goes on as if the store were unreachable
  (CheckpointStoreReachable says so after its grace, the resume step stays unknown, hang
  detection pauses), and a read that finishes later only frees its slot.

The step-directory scan of one read is bounded too (checkpoints.SCAN_PAGES, SCAN_READS).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import TrainingJobStatus
from topotrain.controller.indexes import JobKey
from topotrain.controller.observe import Observer, Problem
from topotrain.core.reconcile_status import CheckpointView

STORE_THREADS = 32
PER_NAMESPACE = 2
DEADLINE_SECONDS = 30.0

T = TypeVar("T")


class StoreDeadline(TimeoutError):
    """A store read did not end within its deadline."""


class StoreCalls:
    """The bounded pool of checkpoint-store reads (one per operator process)."""

    def __init__(self, threads: int = STORE_THREADS, per_namespace: int = PER_NAMESPACE,
                 deadline: float = DEADLINE_SECONDS) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="topotrain-store")
        self.per_namespace = per_namespace
        self.deadline = deadline
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._running: dict[str, int] = {}

    def running(self, namespace: str) -> int:
        """Reads of `namespace` holding a thread now (stuck ones included)."""
        return self._running.get(namespace, 0)

    def _done(self, namespace: str, slots: asyncio.Semaphore) -> None:
        self._running[namespace] -= 1
        slots.release()

    async def run(self, namespace: str, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in the store pool, within the deadline (StoreDeadline past it)."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + self.deadline
        slots = self._slots.setdefault(namespace, asyncio.Semaphore(self.per_namespace))
        try:
            await asyncio.wait_for(slots.acquire(), self.deadline)
        except TimeoutError:
            raise StoreDeadline(
                f"no checkpoint-store read of namespace {namespace} could start within "
                f"{self.deadline:.0f}s: its {self.per_namespace} reads in flight have not ended "
                "(a store that answers too slowly)") from None
        self._running[namespace] = self._running.get(namespace, 0) + 1
        future = loop.run_in_executor(self.pool, fn, *args)
        future.add_done_callback(lambda _: self._done(namespace, slots))  # the thread is free
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, ends - loop.time()))
        except TimeoutError:
            raise StoreDeadline(f"the checkpoint store did not answer within {self.deadline:.0f}s "
                                "(a deadline per read, not per socket read)") from None

    async def checkpoint(self, observer: Observer, key: JobKey, spec: TrainingJobSpec,
                         status: TrainingJobStatus, force: bool = False
                         ) -> tuple[Problem, CheckpointView | None]:
        """Observer.checkpoint within the bounds; past the deadline the store reads as unreachable."""
        try:
            return await self.run(key[0], observer.checkpoint, key, spec, status, force)
        except StoreDeadline as exc:
            return None, CheckpointView(reachable=False, error=str(exc))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
