"""What bench/versus.py observes, the same way for both systems: a poll of the namespace's
pods that records, on this machine's clock, when each gang first had all its live pods
Running (at least its smallest allowed size), and on which node each pod index ran; and
the node loss that a recovery is timed from."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

POLL_SECONDS = 0.5


@dataclass
class Gang:
    applied: float = 0.0
    running: float | None = None
    nodes: dict[int, str] = field(default_factory=dict)  # pod index -> node, when first Running


@dataclass(frozen=True)
class PodView:
    uid: str
    job: str
    index: int
    node: str
    phase: str
    live: bool  # not deleting, not finished


def pod_views(pods: list[Any], job_label: str, index_label: str) -> list[PodView]:
    views = []
    for pod in pods:
        labels = pod.metadata.labels or {}
        job, index = labels.get(job_label), labels.get(index_label)
        if job is None or index is None:
            continue
        phase = pod.status.phase or ""
        live = pod.metadata.deletion_timestamp is None and phase not in ("Succeeded", "Failed")
        views.append(
            PodView(pod.metadata.uid, job, int(index), pod.spec.node_name or "", phase, live)
        )
    return views


def gang_running(views: list[PodView], least: int, avoid: str = "") -> dict[int, str] | None:
    """Pod index -> node when the live pods are at least `least`, all Running, one per index.
    Pods on `avoid` (a deleted node) count as lost: nothing runs them any more."""
    live = [v for v in views if v.live and not (avoid and v.node == avoid)]
    if len(live) < least or any(v.phase != "Running" for v in live):
        return None
    nodes = {v.index: v.node for v in live}
    return nodes if len(nodes) == len(live) else None


class GangWatch:
    """Polls the namespace's pods; gangs keyed by `job_label`, pods ordered by `index_label`."""

    def __init__(self, api: client.ApiClient, namespace: str, job_label: str, index_label: str,
                 least: dict[str, int]) -> None:  # fmt: skip
        self.core = client.CoreV1Api(api)
        self.namespace, self.job_label, self.index_label = namespace, job_label, index_label
        self.least = least
        self.gangs: dict[str, Gang] = {}
        self.last_change = time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gang-watch", daemon=True)
        self._thread.start()

    def applied(self, name: str, when: float) -> None:
        with self._lock:
            self.gangs.setdefault(name, Gang()).applied = when

    def snapshot(self) -> dict[str, Gang]:
        with self._lock:
            return {k: Gang(g.applied, g.running, dict(g.nodes)) for k, g in self.gangs.items()}

    def views(self) -> list[PodView]:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=self.job_label).items
        return pod_views(pods, self.job_label, self.index_label)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                views = self.views()
            except (ApiException, HTTPError, OSError, ValueError):
                self._stop.wait(POLL_SECONDS)
                continue
            seen = time.time()
            by_job: dict[str, list[PodView]] = {}
            for view in views:
                by_job.setdefault(view.job, []).append(view)
            with self._lock:
                for job, job_views in by_job.items():
                    gang = self.gangs.setdefault(job, Gang())
                    if gang.running is not None:
                        continue
                    nodes = gang_running(job_views, self.least.get(job, 1))
                    if nodes is not None:
                        gang.running, gang.nodes = seen, nodes
                        self.last_change = seen
            self._stop.wait(POLL_SECONDS)


@dataclass(frozen=True)
class Recovery:
    seconds: float | None  # None: not Running again before the timeout
    pods_created: int
    node: str


def time_recovery(watch: GangWatch, job: str, least: int, kill: Callable[[str], None],
                  node: str, timeout: float) -> Recovery:  # fmt: skip
    """Kill `node` (one of `job`'s), then poll until the gang is all Running again with no
    pod on it; counts the pods of the job created after the kill."""
    before = {v.uid for v in watch.views() if v.job == job}
    created: set[str] = set()
    start = time.monotonic()
    kill(node)
    while time.monotonic() - start < timeout:
        views = [v for v in watch.views() if v.job == job]
        created |= {v.uid for v in views} - before
        running = gang_running(views, least, avoid=node)
        fresh = {v.uid for v in views if v.live and v.node != node} & created
        if running is not None and fresh:
            return Recovery(time.monotonic() - start, len(created), node)
        time.sleep(0.25)
    return Recovery(None, len(created), node)
