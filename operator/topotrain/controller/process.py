"""The state every job's loop shares in one operator process.

One `Operator` per process (main.py makes it at start-up): the settings, the API client,
the ledger of pods created but not yet seen, the ghost pods and nodes left out of the watch
cache, the fleet's free GPUs, the plan lock and its thread, each loop's wake-up event and the
status it last wrote, and what wakes whom (the jobs waiting for capacity, the nodes of each
job's pods).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kopf

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import ConditionType, TrainingJobStatus
from topotrain.controller.fleet import Fleet
from topotrain.controller.indexes import JobKey, index_values, job_of
from topotrain.controller.kube import Kube
from topotrain.controller.leader import Leadership
from topotrain.controller.metrics import METRICS
from topotrain.controller.settings import Settings
from topotrain.controller.snapshot import Ghosts, Ledger
from topotrain.controller.storecalls import StoreCalls

log = logging.getLogger("topotrain.jobs")
STARTUP_SECONDS = 30.0  # the first resync waits this long (the watches' first LISTs fill the indexes)
RELIST_SETTLE_SECONDS = 5.0  # after a watch's re-list: the resync runs once the LIST's events landed


@dataclass
class Operator:
    """Process-wide state shared by every job's loop."""

    settings: Settings
    kube: Kube
    ledger: Ledger = field(default_factory=Ledger)
    ghosts: Ghosts = field(default_factory=Ghosts)
    node_ghosts: Ghosts = field(default_factory=Ghosts)  # nodes deleted while the watch was away
    fleet: Fleet | None = None  # free GPUs kept from the watch (main.py feeds it); None: recounted
    plan_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The Lease this replica must hold to act (leader.py); None: standalone, it always acts.
    leader: Leadership | None = None
    # The thread that decides under plan_lock (only the lock's holder uses it, so it is free)
    planner: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="topotrain-plan"))
    # Checkpoint-store reads: a pool of their own, a cap per namespace, a deadline each
    store_calls: StoreCalls = field(default_factory=StoreCalls)
    wakers: dict[JobKey, asyncio.Event] = field(default_factory=dict)
    # The status each job's loop last wrote, with the uid of the object it wrote it to: a job
    # deleted and re-created under its name is another object, whose loop starts before the old
    # one has stopped, and must never build on (or patch against) the old object's status.
    written: dict[JobKey, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    # The resourceVersion the API server gave the job for that write (the next write tests it).
    versions: dict[JobKey, str] = field(default_factory=dict)
    # What wakes a job besides its own pods' events (kept from each job's last pass): jobs that
    # could use GPUs freed anywhere, and the nodes each job's pods are on. A GPU pod ending or a
    # node changing wakes only the jobs it can affect, not every loop of a 200-job operator.
    wants_capacity: set[JobKey] = field(default_factory=set)
    nodes_of: dict[JobKey, frozenset[str]] = field(default_factory=dict)
    _resyncing: bool = False
    _next_resync: float = field(default_factory=lambda: time.monotonic() + STARTUP_SECONDS)
    _started: float = field(default_factory=time.monotonic)

    def wake(self, key: JobKey) -> None:
        event = self.wakers.get(key)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for event in list(self.wakers.values()):
            event.set()

    def leadership_changed(self, acting: bool) -> None:
        """Gaining the Lease: forget the statuses written in an earlier term (another replica may
        have written since) and start every job's pass; losing it: the loops see it themselves."""
        METRICS.leader.set(1 if acting else 0)
        if acting:
            self.written.clear()
            self.versions.clear()
            self.wake_all()

    async def write_status(self, key: JobKey, uid: str, status: TrainingJobStatus,
                           version: str | None, fenced: bool = False) -> str | None:
        """Write a job's status if it changed, or with `fenced` (the pass goes on to touch pods)
        anyway: either way only onto `version`, the job's resourceVersion the pass read
        (StaleWrite otherwise). Returns the version to test next."""
        wire = status.to_wire()
        old = self.last_written(key, uid) or {}
        if wire == old and not fenced:
            return version
        try:
            version = await asyncio.to_thread(self.kube.patch_status, *key, old, wire, uid or None, version)
        except Exception:
            # Refused (this object is gone, or the status is not what we last wrote): the next
            # pass starts again from the object as the watch shows it.
            if self.last_written(key, uid) is not None:
                self.written.pop(key, None)
                self.versions.pop(key, None)
            raise
        self.written[key], self.versions[key] = (uid, wire), version
        return version

    def read_version(self, key: JobKey, uid: str, body: Any) -> str | None:
        """The resourceVersion a pass decides from, which its writes test (compare-and-swap): the
        watched object's when the pass reads its status from there (nothing written by this loop,
        or the watch already shows what it wrote), else the one this loop's last write returned
        (the watch has not caught up with it yet)."""
        meta = body.get("metadata") or {}
        seen = str(meta.get("resourceVersion") or "") or None
        entry = self.written.get(key)
        if entry is None or entry[0] != uid or dict(body.get("status") or {}) == entry[1]:
            return seen
        return self.versions.get(key) or seen

    def wake_for_capacity(self) -> None:
        """GPUs are being freed: the jobs waiting for capacity (or able to grow) may fit now."""
        for key in list(self.wants_capacity):
            self.wake(key)

    def wake_for_node(self, node: str) -> None:
        """A node changed: the jobs with pods on it, and those waiting for capacity."""
        self.wake_for_capacity()
        for key, nodes in list(self.nodes_of.items()):
            if node in nodes:
                self.wake(key)

    def note(self, key: JobKey, wants_capacity: bool, nodes: frozenset[str]) -> None:
        """Record what the job's last pass showed it depends on."""
        if wants_capacity:
            self.wants_capacity.add(key)
        else:
            self.wants_capacity.discard(key)
        self.nodes_of[key] = nodes

    def relisted(self) -> None:
        """A watch LISTed again after start-up (its stream broke with "410 Gone", or a paused
        standby resumed): kopf adds what the LIST shows and removes nothing, so a pod or node
        deleted while the watch was away stays in the index. Resync soon, not at the interval."""
        now = time.monotonic()
        if self.settings.resync_seconds and now - self._started > STARTUP_SECONDS \
                and self._next_resync > now + RELIST_SETTLE_SECONDS:
            log.info("a watch LISTed again: resyncing pods and nodes in %.0fs", RELIST_SETTLE_SECONDS)
            self._next_resync = now + RELIST_SETTLE_SECONDS

    async def resync_if_due(self, pods: kopf.Index[str, Any], nodes: kopf.Index[str, Any] | None = None) -> None:
        """Every `resync_seconds` (and soon after a re-list), one job's loop compares the pod and
        node indexes with metadata-only LISTs (Ghosts)."""
        every = self.settings.resync_seconds
        if not every or self._resyncing or time.monotonic() < self._next_resync:
            return
        self._resyncing = True
        try:
            found, gone = await asyncio.gather(asyncio.to_thread(
                self.ghosts.resync, index_values(pods),
                lambda cached: self.kube.pod_uids(self.settings.namespaces, cached=cached),
            ), asyncio.to_thread(
                self.node_ghosts.resync, [] if nodes is None else index_values(nodes),
                lambda cached: self.kube.metadata_list("nodes", None, cached=cached)))
        except Exception as exc:  # the API server is unwell: the next interval tries again
            log.warning("resync failed: %s", exc)
            return
        finally:
            self._resyncing, self._next_resync = False, time.monotonic() + every
        log.info("resync done: the pod and node indexes compared with the API server's LISTs")
        if found:
            names = sorted(f"{p['metadata'].get('namespace')}/{p['metadata'].get('name')}" for p in found)
            log.warning("the watch cache shows %d pod(s) two LISTs do not (deletions the watch "
                        "missed): leaving them out from now on: %s", len(found), ", ".join(names[:10]))
            self.ghosts_found(len(found), {k for k in map(job_of, found) if k is not None})
        if gone:
            self.nodes_gone(gone)

    def nodes_gone(self, gone: list[Mapping[str, Any]]) -> None:
        """Ghost nodes: out of the fleet (no plan pins a pod to them), out of every pass's node
        views (a pod on one or planned for one is NodeLost); the jobs they affect look again."""
        names = sorted(str(n["metadata"].get("name")) for n in gone)
        log.warning("the watch cache shows %d node(s) two LISTs do not (deletions the watch "
                    "missed): leaving them out from now on: %s", len(gone), ", ".join(names[:10]))
        METRICS.ghost_nodes.inc(len(gone))
        for node in gone:
            if self.fleet is not None:
                self.fleet.node_gone(str(node["metadata"].get("name")), str(node["metadata"].get("uid")))
        for name in names:
            self.wake_for_node(name)

    def ghosts_found(self, count: int, jobs: Iterable[JobKey]) -> None:
        """Ghost pods left the snapshot: count them; their jobs and those waiting for capacity
        (the GPUs a ghost held are free to plan with now) look again."""
        METRICS.ghost_pods.inc(count)
        for key in jobs:
            self.wake(key)
        self.wake_for_capacity()

    def forget(self, key: JobKey, event: asyncio.Event) -> None:
        """A job's loop ended: drop what it kept, unless a newer loop (a namesake re-created
        while this one was stopping) owns the name now."""
        if self.wakers.get(key) is not event:
            return
        del self.wakers[key]
        self.written.pop(key, None)
        self.versions.pop(key, None)
        self.wants_capacity.discard(key)
        self.nodes_of.pop(key, None)

    def last_written(self, key: JobKey, uid: str) -> dict[str, Any] | None:
        """The status this object's loop last wrote (None: none, or it was a namesake's)."""
        entry = self.written.get(key)
        return entry[1] if entry is not None and entry[0] == uid else None


def wants_capacity(status: TrainingJobStatus, spec: TrainingJobSpec) -> bool:
    """Whether GPUs freed anywhere, or any node changing, may let this job move on: every job
    that is not Running (waiting to be placed, recovering, starting), and a Running job below its
    wanted data degree (it may grow). A finished or suspended job, or one Running at full size,
    needs neither (un-suspending is a spec change, which wakes the job itself)."""
    if status.phase in ("Succeeded", "Failed", "Suspended"):
        return False
    admitted = status.condition(ConditionType.ADMITTED)
    if admitted is not None and admitted.status != "True":
        return False  # Kueue decides when it may start; its Workload's events wake it
    if status.phase != "Running":
        return True
    running = status.parallelism.data if status.parallelism else None
    return running is not None and running < spec.parallelism.data
