"""What one job's pass reads from kopf's watch indexes (`WatchLook`): the pods and nodes its
snapshot is built from, scoped to the job when the operator knows its fleet."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import kopf

from topotrain.controller.indexes import IndexedNodes, JobKey, index_values, job_pods_key
from topotrain.controller.process import Operator
from topotrain.controller.snapshot import Snapshot


class WatchLook:
    """What one job's pass reads from the watch indexes: with the operator's fleet, a scoped
    snapshot (the job's pods, nodes found by name); without one, every node and pod."""

    def __init__(self, op: Operator, key: JobKey, pods: kopf.Index[Any, Any],
                 nodes: kopf.Index[Any, Any]) -> None:  # fmt: skip
        self.op, self.key, self._pods, self._nodes = op, key, pods, nodes
        self.pods: list[Mapping[str, Any]] = []  # this look's pods (ghosts left out)

    def take(self) -> Callable[[], Snapshot]:
        """Read the indexes now (in the event loop, where they change); the snapshot is built
        by the returned function in a worker thread."""
        op, ghosts = self.op, self.op.ghosts.current()
        fleet = op.fleet
        if fleet is None or fleet.levels != op.settings.labels:
            nodes = op.node_ghosts.drop(index_values(self._nodes))
            self.pods = op.ghosts.drop(index_values(self._pods))
            pods = self.pods
            return lambda: Snapshot.take(nodes, pods, op.ledger, fleet, ghosts)
        self.pods = op.ghosts.drop(index_values(self._pods, job_pods_key(self.key)), every=False)
        pods, index, lookup = self.pods, self._pods, IndexedNodes(self._nodes, op.node_ghosts.current())

        names: dict[JobKey, frozenset[str]] = {}  # per job, read once a look (not once a ledger entry)

        def shown(job: JobKey, pod: tuple[str, str]) -> bool:
            if job not in names:
                store = index.get(job_pods_key(job))
                names[job] = frozenset(p["metadata"]["name"] for p in list(store or ())
                                       if p["metadata"].get("uid") not in ghosts)
            return pod[1] in names[job]

        return lambda: Snapshot.for_job(lookup, pods, op.ledger, fleet, shown, ghosts)
