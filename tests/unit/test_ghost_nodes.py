"""Nodes deleted while the operator's watch was away (issue 37 item 4): kopf's re-list adds what it
finds and removes nothing, so such a node stayed in the index and the fleet, Ready with every GPU
free. The resync (controller/process.py) lists node metadata twice, prunes the ghost from the fleet
and from every pass's node views: no plan pins a pod to it, and a pod planned for it is NodeLost.

The kopf indexes and the API server's LISTs are fakes at this unit-test boundary (named below);
tests/integration/test_operator_ghost_nodes.py drops a real watch on the testbed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import pytest
from topotrain.api.spec import FailurePolicy
from topotrain.api.status import Reason
from topotrain.controller import process, snapshot
from topotrain.controller.fleet import Fleet
from topotrain.controller.indexes import (
    IndexedNodes,
    node_entries,
    pod_entries,
    slim_node,
    slim_pod,
)
from topotrain.controller.loop import WatchLook
from topotrain.controller.process import Operator
from topotrain.controller.settings import Settings
from topotrain.core.manifests import ATTEMPT_LABEL, INDEX_LABEL, JOB_LABEL, NODE_ANNOTATION
from topotrain.core.policy import detect_failure
from topotrain.placement.topology import TopologyLevels

from tests.unit.kopf_index import as_index

LEVELS = TopologyLevels()
JOB = ("ns", "j")


def node(name: str, uid: str, gpus: int = 8) -> dict[str, Any]:
    return slim_node({
        "metadata": {"name": name, "uid": uid, "labels": {LEVELS.product: "H100", LEVELS.rack: "r0"}},
        "status": {"allocatable": {LEVELS.gpu_resource: str(gpus)},
                   "conditions": [{"type": "Ready", "status": "True"}]},
    })  # fmt: skip


def planned_pod(on: str) -> dict[str, Any]:
    """A pod of JOB's attempt 1, created gated and planned for node `on` (not bound yet)."""
    return slim_pod({
        "metadata": {"name": "j-1-0", "namespace": "ns", "uid": "pod-1",
                     "labels": {JOB_LABEL: "j", ATTEMPT_LABEL: "1", INDEX_LABEL: "0"},
                     "annotations": {NODE_ANNOTATION: on},
                     "ownerReferences": [{"kind": "TrainingJob", "name": "j", "uid": "job-uid", "controller": True}]},
        "spec": {"schedulingGates": [{"name": "topotrain.io/gang"}],
                 "containers": [{"resources": {"limits": {LEVELS.gpu_resource: "8"}}}]},
        "status": {"phase": "Pending"},
    })  # fmt: skip


class FakeLists:
    """A fake of the API server's metadata-only LISTs: the nodes and pods that exist now."""

    def __init__(self, nodes: dict[str, str], pods: set[str]) -> None:
        self.nodes, self.pods, self.calls = nodes, pods, 0

    def pod_uids(self, namespaces: tuple[str, ...], *, cached: bool) -> set[str]:
        return set(self.pods)

    def metadata_list(self, plural: str, namespace: str | None, *, cached: bool) -> dict[str, str]:
        assert plural == "nodes" and namespace is None
        self.calls += 1
        return dict(self.nodes)


def test_a_ghost_node_leaves_the_fleet_and_a_namesake_created_since_stays() -> None:
    fleet = Fleet(LEVELS)
    for name, uid in (("n0", "u0"), ("n1", "u1")):
        fleet.node_seen(node(name, uid))
    fleet.node_gone("n0", "u0")
    assert set(fleet.inventory(JOB, None, [], {}).nodes) == {"n1"}
    fleet.node_seen(node("n1", "u1-new"))  # n1 deleted and created again before the resync judged it
    fleet.node_gone("n1", "u1")  # the old object's ghost
    assert set(fleet.inventory(JOB, None, [], {}).nodes) == {"n1"}, "the new n1 is a real node"
    fleet.node_gone("n1")  # a DELETED event names no uid
    assert fleet.inventory(JOB, None, [], {}).nodes == {}


@pytest.fixture
def no_second_look(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot, "SECOND_LOOK_SECONDS", 0.0)


@pytest.mark.usefixtures("no_second_look")
def test_a_resync_prunes_a_node_deleted_while_the_watch_was_away() -> None:
    ghost, live = node("n0", "u0"), node("n1", "u1")
    pod = planned_pod("n0")
    nodes_index = as_index([node_entries(ghost), node_entries(live)])  # the re-list kept n0
    pods_index = as_index([pod_entries(pod)])
    lists = FakeLists(nodes={"u1": "n1"}, pods={"pod-1"})  # n0 is gone from the API server
    op = Operator(settings=replace(Settings(), resync_seconds=60), kube=lists,  # type: ignore[arg-type]
                  fleet=Fleet(LEVELS))
    for slim in (ghost, live):
        op.fleet.node_seen(slim)  # type: ignore[union-attr]
    op.fleet.pod_seen(pod)  # type: ignore[union-attr]
    op.wakers[JOB] = asyncio.Event()
    op.note(JOB, False, frozenset({"n0"}))

    before = WatchLook(op, JOB, pods_index, nodes_index).take()()  # type: ignore[arg-type]
    assert before.inventory(("ns", "other"), LEVELS, [], {}).nodes["n0"].free == 0, \
        "n0's 8 GPUs are held by the job's planned pod"
    assert set(before.inventory(JOB, LEVELS, [], {}, uid="job-uid").nodes) == {"n0", "n1"}, \
        "before the resync the job's own plan would pin its next pod to the ghost again"

    op._next_resync = 0.0
    asyncio.run(op.resync_if_due(pods_index, nodes_index))  # type: ignore[arg-type]

    assert lists.calls == 2, "a cached LIST, then a consistent one for the suspect"
    assert op.wakers[JOB].is_set(), "the job with a pod planned for the ghost looks again"
    after = WatchLook(op, JOB, pods_index, nodes_index).take()()  # type: ignore[arg-type]
    assert set(after.inventory(JOB, LEVELS, [], {}, uid="job-uid").nodes) == {"n1"}
    views = after.node_views()
    assert "n0" not in views and "n0" not in list(views) and len(views) == 1
    failure = detect_failure(after.job_pods(JOB, "job-uid"), 1, views, FailurePolicy(), started=False)
    assert failure is not None and failure.reason == Reason.NODE_LOST and failure.lost_nodes == {"n0"}
    assert "n0" in IndexedNodes(nodes_index) and "n0" not in IndexedNodes(nodes_index, frozenset({"u0"}))


def test_a_relist_after_start_up_brings_the_resync_forward() -> None:
    op = Operator(settings=replace(Settings(), resync_seconds=120), kube=None)  # type: ignore[arg-type]
    due = op._next_resync
    op.relisted()  # the watches' first LISTs at start-up: the index is fresh, nothing to compare
    assert op._next_resync == due
    op._started -= process.STARTUP_SECONDS + 1
    op._next_resync = time.monotonic() + 120
    op.relisted()
    assert op._next_resync <= time.monotonic() + process.RELIST_SETTLE_SECONDS
