"""The free-GPU counts kept from watch events (topotrain.controller.fleet) equal a full recount.

Random sequences of node and pod events (added, modified, deleted; a pod replaced by a namesake
without a deletion, as after a re-list) are applied both to a dict standing for kopf's index and to
a `Fleet`; then every job's inventory from the fleet must equal the one `Inventory.from_snapshot`
rebuilds from the index's nodes and pods (with the ledger's unseen pods and ghosts left out), for
jobs with and without a known uid, tolerations, a nodeSelector and avoided nodes.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from topotrain.controller.fleet import Fleet
from topotrain.controller.indexes import node_entries, pod_entries, slim_node, slim_pod
from topotrain.controller.loop import WatchLook
from topotrain.controller.process import Operator
from topotrain.controller.settings import Settings
from topotrain.controller.snapshot import Ghosts, Ledger, Snapshot
from topotrain.core.manifests import ATTEMPT_LABEL, INDEX_LABEL, JOB_LABEL, NODE_ANNOTATION
from topotrain.placement.topology import TopologyLevels

from tests.unit.kopf_index import as_index

LEVELS = TopologyLevels()
NODES = [f"n{i}" for i in range(6)]
JOBS = [("ns", "a"), ("ns", "b"), ("other", "a")]
OWNERS = ["uid-a", "uid-a2", "uid-b", None]
TAINT = {"key": "gpu", "value": "broken", "effect": "NoSchedule"}


def node_body(name: str, ready: bool, cordoned: bool, tainted: bool, gpus: str | None, pool: str,
              rack: str, clique: str | None, team: str) -> dict[str, Any]:
    labels = {LEVELS.product: pool, LEVELS.block: "b0", LEVELS.rack: rack, "team": team}
    if clique:
        labels[LEVELS.nvlink] = clique
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": cordoned, "taints": [dict(TAINT)] if tainted else []},
        "status": {"allocatable": {} if gpus is None else {LEVELS.gpu_resource: gpus},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def pod_body(namespace: str, name: str, uid: str, job: str | None, owner: str | None, node: str | None,
             planned: str | None, phase: str, deleting: bool, gpus: int) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid, "labels": {}, "annotations": {}}
    if job:
        meta["labels"][JOB_LABEL] = job
    if owner:
        meta["ownerReferences"] = [{"kind": "TrainingJob", "name": job or "x", "uid": owner, "controller": True}]
    if planned:
        meta["annotations"][NODE_ANNOTATION] = planned
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"resources": {"limits": {LEVELS.gpu_resource: str(gpus)}}}]},
        "status": {"phase": phase},
    }


node_events = st.tuples(
    st.just("node"), st.sampled_from(["upsert", "upsert", "delete"]), st.sampled_from(NODES),
    st.sampled_from([True, True, True, False]), st.sampled_from([False, False, False, True]),
    st.sampled_from([False, False, False, True]), st.sampled_from(["64", "64", "16", "0", None]),
    st.sampled_from(["H100", "A100"]), st.sampled_from(["r0", "r1"]), st.sampled_from([None, "c0", "c1"]),
    st.sampled_from(["x", "y"]),
)
pod_events = st.tuples(
    st.just("pod"), st.sampled_from(["upsert", "upsert", "upsert", "delete"]),
    st.sampled_from(["ns", "other"]), st.sampled_from([f"p{i}" for i in range(8)]), st.integers(0, 2),
    st.sampled_from(["a", "b", None]), st.sampled_from(OWNERS), st.sampled_from([None, *NODES]),
    st.sampled_from([None, *NODES, *NODES]), st.sampled_from(["Pending", "Running", "Running", "Succeeded", "Failed"]),
    st.booleans(), st.sampled_from([1, 2, 4]),
)
queries = st.tuples(
    st.sampled_from(JOBS), st.sampled_from([None, "uid-a", "uid-b", ""]), st.booleans(),
    st.sampled_from([{}, {"team": "x"}]), st.frozensets(st.sampled_from(NODES), max_size=2),
)


def replay(events: list[tuple[Any, ...]]) -> tuple[dict[str, Any], dict[tuple[str, str], Any], Fleet]:
    """The events applied to an index (node name / (namespace, name) -> slim dict) and a Fleet."""
    nodes: dict[str, Any] = {}
    pods: dict[tuple[str, str], Any] = {}
    fleet = Fleet(LEVELS)
    for event in events:
        if event[0] == "node":
            _, action, name, *fields = event
            if action == "delete":
                if nodes.pop(name, None) is not None:
                    fleet.node_gone(name)
                continue
            slim = slim_node(node_body(name, *fields))
            fleet.node_seen(slim)
            nodes[name] = slim
        else:
            _, action, namespace, name, generation, job, owner, node, planned, phase, deleting, gpus = event
            key = (namespace, name)
            if action == "delete":
                if (gone := pods.pop(key, None)) is not None:
                    fleet.pod_gone(gone)
                continue
            uid = f"{namespace}-{name}-{generation}"  # another generation: a namesake's pod
            slim = slim_pod(pod_body(namespace, name, uid, job, owner, node, planned, phase, deleting, gpus))
            fleet.pod_seen(slim)
            pods[key] = slim
    return nodes, pods, fleet


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(node_events, pod_events), min_size=8, max_size=80), st.lists(queries, min_size=1, max_size=4),
       st.lists(st.tuples(st.sampled_from(JOBS), st.sampled_from(OWNERS), st.sampled_from(NODES)), max_size=3),
       st.integers(0, 3))
def test_kept_counts_equal_a_full_recount(events: list[tuple[Any, ...]], asks: list[tuple[Any, ...]],
                                          created: list[tuple[Any, ...]], ghost_count: int) -> None:
    nodes, pods, fleet = replay(events)
    ledger = Ledger()
    for i, ((namespace, job), owner, node) in enumerate(created):  # created, not watched yet
        ledger.record((namespace, job), pod_body(namespace, f"new{i}", "", job, owner, None, node,
                                                 "Pending", False, 8))
    ghosts = frozenset(sorted(str(p["metadata"]["uid"]) for p in pods.values())[:ghost_count])
    listed = [p for p in pods.values() if p["metadata"]["uid"] not in ghosts]  # as Ghosts.drop leaves them
    full = Snapshot.take(nodes.values(), listed, ledger)
    kept = Snapshot.take(nodes.values(), listed, ledger, fleet, ghosts)
    for job, uid, tolerate, selector, avoid in asks:
        tolerations = [{"key": "gpu", "operator": "Exists"}] if tolerate else []
        want = full.inventory(job, LEVELS, tolerations, selector, avoid, uid)
        got = kept.inventory(job, LEVELS, tolerations, selector, avoid, uid)
        assert got == want
        assert list(got.nodes) == list(want.nodes) and list(got.known) == list(want.known)


def test_a_deletion_of_an_older_pod_leaves_its_namesakes_hold() -> None:
    """A DELETED event that names the pod another uid had (a re-list already replaced it)."""
    fleet = Fleet(LEVELS)
    fleet.node_seen(slim_node(node_body("n0", True, False, False, "8", "H100", "r0", None, "x")))
    old = slim_pod(pod_body("ns", "p", "uid-1", "a", "uid-a", "n0", None, "Running", False, 8))
    new = slim_pod(pod_body("ns", "p", "uid-2", "a", "uid-a", "n0", None, "Running", False, 4))
    fleet.pod_seen(old)
    fleet.pod_seen(new)
    fleet.pod_gone(old)
    assert fleet.inventory(("ns", "b"), None, [], {}).nodes["n0"].free == 4
    fleet.pod_gone(new)
    assert fleet.inventory(("ns", "b"), None, [], {}).nodes["n0"].free == 8


def test_a_snapshot_with_other_topology_labels_recounts() -> None:
    """The fleet parses nodes with the operator's labels; a caller with others gets a full recount."""
    fleet = Fleet(LEVELS)
    body = node_body("n0", True, False, False, "8", "H100", "r0", None, "x")
    fleet.node_seen(slim_node(body))
    custom = TopologyLevels(rack="example.com/row")
    snapshot = Snapshot.take([slim_node(body)], [], Ledger(), fleet)
    assert snapshot.inventory(("ns", "a"), custom, [], {}).nodes["n0"].rack == ("b0", "")


def test_every_kind_of_single_pod_counts_as_a_recount_does() -> None:
    """Each combination of job label, binding, planned node, phase and deletion, one at a time
    (the random sequences above reach some of them only rarely)."""
    node = slim_node(node_body("n0", True, False, False, "64", "H100", "r0", None, "x"))
    for job, bound, planned, phase, deleting in itertools.product(
            ["a", None], [None, "n0"], [None, "n0"], ["Pending", "Running", "Succeeded", "Failed"], [False, True]):
        fleet = Fleet(LEVELS)
        fleet.node_seen(node)
        pod = slim_pod(pod_body("ns", "p", "uid-p", job, "uid-a", bound, planned, phase, deleting, 4))
        fleet.pod_seen(pod)
        for asking in (("ns", "a"), ("ns", "b")):
            want = Snapshot.take([node], [pod], Ledger()).inventory(asking, LEVELS, [], {})
            assert Snapshot.take([node], [pod], Ledger(), fleet).inventory(asking, LEVELS, [], {}) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(node_events, pod_events), min_size=8, max_size=80), st.lists(queries, min_size=1, max_size=4),
       st.lists(st.tuples(st.sampled_from(JOBS), st.sampled_from(OWNERS), st.sampled_from(NODES),
                          st.sampled_from(["new", *(f"p{i}" for i in range(8))])), max_size=4),
       st.integers(0, 3))
def test_a_jobs_scoped_look_equals_the_full_snapshot(events: list[tuple[Any, ...]], asks: list[tuple[Any, ...]],
                                                     created: list[tuple[Any, ...]], ghost_count: int) -> None:
    """A job's pass reads its own pods and looks nodes up by name (WatchLook); what it decides on
    (the job's pods, a namesake in the way, node readiness, the inventory, the ledger's unseen
    pods) is the same as from every node and pod of the index."""
    nodes, pods, fleet = replay(events)
    for (_, name), slim in pods.items():  # attempt and index labels: pods the reconciler reads
        uid = str(slim["metadata"]["uid"])
        slim["metadata"]["labels"].update({ATTEMPT_LABEL: uid[-1], INDEX_LABEL: name[1:]})
    ghosts = frozenset(sorted(str(p["metadata"]["uid"]) for p in pods.values())[:ghost_count])
    ledgers = Ledger(), Ledger()
    for i, ((namespace, job), owner, node, name) in enumerate(created):  # created, maybe watched already
        there = pods.get((namespace, name))
        if there is not None and there["metadata"]["labels"].get(JOB_LABEL) != job:
            continue  # the API server refuses to create it (409), and the ledger forgets it
        for ledger in ledgers:
            ledger.record((namespace, job), pod_body(namespace, f"new{i}" if name == "new" else name, "", job,
                                                     owner, None, node, "Pending", False, 8))
    op = Operator(settings=Settings(), kube=None, fleet=fleet, ledger=ledgers[1],  # type: ignore[arg-type]
                  ghosts=Ghosts(uids=set(ghosts)))
    full = Snapshot.take(nodes.values(), Ghosts(uids=set(ghosts)).drop(pods.values()), ledgers[0])
    node_index = as_index([node_entries(n) for n in nodes.values()])
    pod_index = as_index([pod_entries(p) for p in pods.values()])
    for job, uid, tolerate, selector, avoid in asks:
        scoped = WatchLook(op, job, pod_index, node_index).take()()  # type: ignore[arg-type]
        assert scoped.nodes == [] and len(scoped.pods) < len(full.pods) + 1
        assert scoped.job_pods(job, uid) == full.job_pods(job, uid)
        for attempt in range(3):
            assert scoped.foreign_problem(job, uid or "", attempt) == full.foreign_problem(job, uid or "", attempt)
        views, want_views = scoped.node_views(), full.node_views()
        assert sorted(views) == sorted(want_views)
        for name in [*NODES, "absent"]:
            assert (name in views) == (name in want_views)
            assert views.get(name) == want_views.get(name)
        tolerations = [{"key": "gpu", "operator": "Exists"}] if tolerate else []
        assert (scoped.inventory(job, LEVELS, tolerations, selector, avoid, uid)
                == full.inventory(job, LEVELS, tolerations, selector, avoid, uid))
        assert sorted(str(p["metadata"]["name"]) for p in scoped.unseen) == sorted(
            str(p["metadata"]["name"]) for p in full.unseen)
