"""Which operator replica acts: a `coordination.k8s.io/v1` Lease, timed on this process's own clock.

Every replica watches (its indexes and fleet stay warm); only the Lease's holder runs job
passes. The rules, one `Elector.try_once` per retry period:

- A free Lease (absent, or released: no holder) is taken at once.
- A Lease held by another is judged expired only after this replica has seen the same
  record (its resourceVersion: any renewal changes it) unchanged for the Lease's
  `leaseDurationSeconds` on its own monotonic clock. Timestamps written by other machines
  (`renewTime`) are shown to people and never compared with this clock.
- Every write (take, renew, release) replaces the Lease with the resourceVersion it read:
  the API server refuses it (409) when anyone wrote in between, so two candidates never
  both take it.
- The holder acts only while its last successful renewal *started* less than
  `renew_deadline` ago (`acting()`, computed from the clock each time it is asked, so a
  process resumed after SIGSTOP sees at once that it may not act). With
  renew_deadline < lease duration, it stops before any other replica can count its Lease
  as expired: another replica's count starts only once it has read the renewed record,
  after that renewal was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from topotrain.controller.kube import ApiException, Kube, StaleWrite

log = logging.getLogger("topotrain.leader")
LEASE_GROUP, LEASE_VERSION = "coordination.k8s.io", "v1"


class NotLeader(Exception):
    """A write was about to be made by a replica that does not hold the Lease (kube.py's fence)."""


# A write refused by the fence or by the API server's compare-and-swap: the pass ends there.
STALE = (NotLeader, StaleWrite)


class LeaseConflict(Exception):
    """The Lease changed since it was read (the API server answered 409 or 422 AlreadyExists)."""


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says (`resource_version`: the server's, "" for one not yet written)."""

    holder: str
    duration_seconds: int
    transitions: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    resource_version: str = ""


class LeaseStore(Protocol):
    """The Lease API (KubeLeases on the API server; a fake in the unit tests)."""

    def read(self) -> LeaseRecord | None: ...

    def create(self, record: LeaseRecord) -> LeaseRecord: ...

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        """Write `record` if the Lease is still at `record.resource_version`; raise LeaseConflict."""
        ...


@dataclass(frozen=True)
class LeaderTiming:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                f"leader election needs 0 < retry period ({self.retry_period:g}) < renew deadline "
                f"({self.renew_deadline:g}) < lease duration ({self.lease_duration:g}) seconds")


def default_identity() -> str:
    """This process among the replicas: the host (a pod's name in a cluster), pid and a nonce."""
    return f"{socket.gethostname()}_{os.getpid()}_{secrets.token_hex(3)}"


def _wall() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """One candidate's view of the Lease, and its decisions (no I/O but the store's calls)."""

    def __init__(self, store: LeaseStore, identity: str, timing: LeaderTiming,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], str] = _wall) -> None:
        self.store, self.identity, self.timing = store, identity, timing
        self.clock, self.wall = clock, wall
        self.renewed_at: float | None = None  # when our last successful take/renew was sent
        self._seen: tuple[str, float] | None = None  # (resourceVersion, when first seen unchanged)

    def acting(self) -> bool:
        """Whether this replica may act now (the fence kube.py checks before every write)."""
        at = self.renewed_at
        return at is not None and self.clock() - at < self.timing.renew_deadline

    def try_once(self) -> None:
        """Read the Lease; take it, renew it or keep counting towards its expiry. API errors
        propagate (nothing is learnt; `acting()` runs out on its own)."""
        sent = self.clock()
        current = self.store.read()
        if current is None:
            self._write(self.store.create, LeaseRecord(
                self.identity, self._duration(), 0, self.wall(), self.wall()), sent)
            return
        if current.holder == self.identity:
            if self.renewed_at is None:  # ours from before a pause or a restart: take it anew
                self._take(current, sent)
            else:
                self._write(self.store.replace, replace(current, renew_time=self.wall(),
                                                        duration_seconds=self._duration()), sent)
            return
        self.renewed_at = None  # another holds it (or held it since): never act on an old renewal
        if not current.holder:  # released by its last holder
            self._take(current, sent)
            return
        now = self.clock()
        if self._seen is None or self._seen[0] != current.resource_version:
            self._seen = (current.resource_version, now)  # a new record: its count starts now
            return
        if now - self._seen[1] >= current.duration_seconds:
            self._take(current, sent)

    def release(self) -> None:
        """Give the Lease up (shutdown): the standby takes it at its next try, not after expiry."""
        if not self.acting():
            return
        self.renewed_at = None
        current = self.store.read()
        if current is not None and current.holder == self.identity:
            self.store.replace(replace(current, holder="", renew_time=self.wall()))

    def _take(self, current: LeaseRecord, sent: float) -> None:
        self._write(self.store.replace, replace(
            current, holder=self.identity, duration_seconds=self._duration(),
            transitions=current.transitions + 1, acquire_time=self.wall(), renew_time=self.wall()), sent)

    def _write(self, call: Callable[[LeaseRecord], LeaseRecord], record: LeaseRecord, sent: float) -> None:
        try:
            written = call(record)
        except LeaseConflict:
            self.renewed_at = None  # someone wrote the Lease meanwhile: stop at once, read again
            self._seen = None
            return
        self.renewed_at = sent
        self._seen = (written.resource_version, self.clock())

    def _duration(self) -> int:
        return max(1, round(self.timing.lease_duration))


class KubeLeases:
    """The Lease `namespace/name` on the API server (through kube.py's client). `owner`: an
    ownerReference every write of the Lease carries (the chart's Deployment, so that
    `helm uninstall` leaves no Lease behind: the garbage collector deletes it with its owner)."""

    def __init__(self, kube: Kube, namespace: str, name: str, timeout: float,
                 owner: Mapping[str, Any] | None = None) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.timeout = (min(timeout, 5.0), timeout)  # a renewal never waits past the deadline
        self.owner = dict(owner) if owner else None

    def _metadata(self, **more: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace, **more}
        if self.owner is not None:
            meta["ownerReferences"] = [self.owner]
        return meta

    def read(self) -> LeaseRecord | None:
        try:
            body = self.kube.custom.get_namespaced_custom_object(
                LEASE_GROUP, LEASE_VERSION, self.namespace, "leases", self.name,
                _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return _record(cast(dict[str, Any], body))

    def create(self, record: LeaseRecord) -> LeaseRecord:
        body = {"apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}", "kind": "Lease",
                "metadata": self._metadata(), "spec": _spec(record)}
        return self._call(lambda: self.kube.custom.create_namespaced_custom_object(
            LEASE_GROUP, LEASE_VERSION, self.namespace, "leases", body, _request_timeout=self.timeout))

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        body = {"apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}", "kind": "Lease",
                "metadata": self._metadata(resourceVersion=record.resource_version), "spec": _spec(record)}
        return self._call(lambda: self.kube.custom.replace_namespaced_custom_object(
            LEASE_GROUP, LEASE_VERSION, self.namespace, "leases", self.name, body,
            _request_timeout=self.timeout))

    def _call(self, call: Callable[[], Any]) -> LeaseRecord:
        try:
            written = call()
        except ApiException as exc:
            if exc.status == 409:  # changed (replace) or created by another (create)
                raise LeaseConflict(self.name) from None
            raise
        return _record(cast(dict[str, Any], written))


def _spec(record: LeaseRecord) -> dict[str, Any]:
    return {"holderIdentity": record.holder or None, "leaseDurationSeconds": record.duration_seconds,
            "leaseTransitions": record.transitions, "acquireTime": record.acquire_time,
            "renewTime": record.renew_time}


def _record(body: dict[str, Any]) -> LeaseRecord:
    spec = body.get("spec") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration_seconds=int(spec.get("leaseDurationSeconds") or 15),
        transitions=int(spec.get("leaseTransitions") or 0),
        acquire_time=spec.get("acquireTime"), renew_time=spec.get("renewTime"),
        resource_version=str((body.get("metadata") or {}).get("resourceVersion") or ""))


class Leadership:
    """Runs the elector in the event loop (its calls in a thread of their own, never queued
    behind job passes) and wakes the job loops when this replica may act."""

    def __init__(self, elector: Elector, on_change: Callable[[bool], None] = lambda _: None) -> None:
        self.elector = elector
        self.on_change = on_change
        self.changed = asyncio.Event()  # set (and replaced) at every tick of the elector
        self._was = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="topotrain-lease")

    def acting(self) -> bool:
        return self.elector.acting()

    def fence(self) -> None:
        """Raise NotLeader unless this replica may act now (called before every write)."""
        if not self.elector.acting():
            raise NotLeader(f"replica {self.elector.identity} does not hold the Lease")

    async def wait_acting(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until this replica may act; whether it may."""
        if self.acting():
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)
        return self.acting()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        timing = self.elector.timing
        while True:
            try:
                await loop.run_in_executor(self._thread, self.elector.try_once)
            except Exception as exc:  # the API server is unwell: acting() runs out by itself
                log.warning("leader election: the Lease could not be read or written: %s", exc)
            self._note()
            # Wake when the fence would close, if that comes before the next try, to say so.
            delay, at = timing.retry_period, self.elector.renewed_at
            if self.elector.acting() and at is not None:
                delay = min(delay, timing.renew_deadline - (self.elector.clock() - at) + 0.01)
            await asyncio.sleep(max(0.01, delay))
            self._note()

    async def release(self) -> None:
        """After `run` was cancelled: give the Lease up (in the elector's thread, after any try
        still running there), then close that thread."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, self.elector.release)
        except Exception as exc:
            log.warning("leader election: the Lease could not be released: %s", exc)
        finally:
            self._thread.shutdown(wait=False)
        self._note()

    def _note(self) -> None:
        now = self.elector.acting()
        if now != self._was:
            self._was = now
            if now:
                log.info("leader election: replica %s holds the Lease and acts", self.elector.identity)
            else:
                log.warning("leader election: replica %s lost the Lease (not renewed within %gs): "
                            "its job passes stop", self.elector.identity, self.elector.timing.renew_deadline)
            self.on_change(now)
        # Wake whoever waits now; later waiters wait for the next tick.
        woken, self.changed = self.changed, asyncio.Event()
        woken.set()
