"""Recovery under Kueue's topology assignment, pure: the real planner on a real inventory, cut
down to the nodes Kueue assigned to the job (kueue_admission.within_assignment) behind
planning.WithinAssignment, and the reconciler's passes around it.

Kueue promises nodes to admitted workloads whose pods may not exist yet; those nodes look free
to the operator. A restart stays on its own assignment and never takes them; when a node of the
assignment is lost and the gang no longer fits on the rest, the job is handed back to Kueue (its
Workload evicted with reason NodeFailures, naming the node), stops, gives its quota back, and
runs again where Kueue assigns it next.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from test_reconcile import T0, gang, run
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.core.decision import Observed
from topotrain.core.kueue_admission import (
    NODE_FAILURES,
    assigned_hosts,
    gate,
    hand_back_status,
    lost_assigned,
    release_status,
    within_assignment,
)
from topotrain.core.planning import PlacementPlanner, WithinAssignment
from topotrain.core.policy import NodeView, PodView
from topotrain.core.reconcile_status import CheckpointView
from topotrain.placement.topology import Inventory, TopologyLevels

LEVELS = TopologyLevels()
HOST = LEVELS.host
OURS = ("n0", "n1", "n2", "n3")  # Kueue's topology assignment of this job: one pod per node
THEIRS = ("m0", "m1")  # assigned to another admitted workload whose pods do not exist yet


def _spec(min_data: int = 2) -> TrainingJobSpec:
    """Four two-GPU pods (tp 2, pp 2, dp 2); not elastic unless `min_data` < 2."""
    return TrainingJobSpec.model_validate({
        "image": "trainer:1",
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2, "minData": min_data},
        "worker": {"gpusPerPod": 2},
        "checkpoint": {"uri": "s3://ckpt/runs"},
        "failurePolicy": {"backoffSeconds": 0, "restartInPlace": False},
    })


def _node(name: str, rack: str, ready: bool = True, cordoned: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {LEVELS.product: "H100", LEVELS.block: "b1",
                                              LEVELS.rack: rack, HOST: name}},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"allocatable": {"nvidia.com/gpu": "2"},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _foreign_pod(node: str, gpus: int) -> dict[str, Any]:
    return {"metadata": {"name": f"other-{node}", "namespace": "x", "labels": {}},
            "spec": {"nodeName": node, "containers": [{"resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": "Running"}}


def _inventory(not_ready: tuple[str, ...] = (), gone: tuple[str, ...] = (), cordoned: tuple[str, ...] = (),
               pods: tuple[dict[str, Any], ...] = ()) -> Inventory:
    """Our four nodes in rack r1, the other workload's two in rack r2 (free: its pods are not
    created yet), all two-GPU H100 nodes."""
    nodes = [_node(n, "r1", ready=n not in not_ready, cordoned=n in cordoned) for n in OURS if n not in gone]
    nodes += [_node(n, "r2") for n in THEIRS]
    return Inventory.from_snapshot(nodes, pods, LEVELS)


def _within(spec: TrainingJobSpec, inventory: Inventory, hosts: Mapping[str, int],
            avoided: frozenset[str] = frozenset()) -> WithinAssignment:
    """The planner the operator's loop builds for an admitted job with a topology assignment."""
    cut = within_assignment(inventory, hosts, spec.worker.gpus_per_pod)
    return WithinAssignment(PlacementPlanner(spec, cut), lost_assigned(inventory, hosts, avoided))


ASSIGNED = dict.fromkeys(OURS, 1)
RUNNING_ON = dict(enumerate(OURS))  # pod index -> node of the running gang


def test_recovery_never_takes_the_nodes_kueue_assigned_to_another_admitted_workload() -> None:
    spec, inventory = _spec(), _inventory(not_ready=("n1",))
    # What planning on the whole admitted flavor does (the operator's fallback before): the
    # replacement of n1's pod lands on a node Kueue promised to the other workload.
    wide = PlacementPlanner(spec, inventory).replan(RUNNING_ON, frozenset({"n1"}), 2, 2)
    assert wide.feasible and set(wide.assignments.values()) & set(THEIRS), wide
    within = _within(spec, inventory, ASSIGNED)
    for outcome in (within.replan(RUNNING_ON, frozenset({"n1"}), 2, 2), within.plan(2, 2)):
        assert not outcome.feasible and not set(outcome.assignments.values()) & set(THEIRS)
        assert outcome.reason == Reason.HANDED_BACK
        assert outcome.message.startswith("node n1 (not Ready) of Kueue's topology assignment is lost")
        assert outcome.message.endswith("handed back to Kueue for a new topology assignment")


def test_a_gang_that_fits_its_own_assignment_restarts_there() -> None:
    """A pod crashed, no node lost: the restart goes back onto the assigned nodes, and the other
    workload's free-looking nodes are not even considered."""
    within = _within(_spec(), _inventory(), ASSIGNED)
    outcome = within.replan(RUNNING_ON, frozenset(), 2, 2)
    assert outcome.feasible and dict(outcome.assignments) == RUNNING_ON
    fresh = within.plan(2, 2)
    assert fresh.feasible and set(fresh.assignments.values()) == set(OURS)


def test_an_elastic_gang_that_lost_a_node_shrinks_inside_its_assignment() -> None:
    """With minData 1 the gang still fits on what is left of its assignment: it restarts smaller
    there rather than hand the job back (or take the other workload's nodes)."""
    outcome = _within(_spec(min_data=1), _inventory(gone=("n1",)), ASSIGNED).replan(
        RUNNING_ON, frozenset({"n1"}), 1, 2)
    assert outcome.feasible and outcome.data == 1
    assert set(outcome.assignments.values()) <= set(OURS) - {"n1"}


def test_room_taken_on_a_healthy_assigned_node_waits_there_instead_of_leaving() -> None:
    """Every assigned node is Ready but one's GPUs are still held (a pod on its way out): no node
    is lost, so the job keeps its assignment and waits for room on it."""
    outcome = _within(_spec(), _inventory(pods=(_foreign_pod("n2", 2),)), ASSIGNED).plan(2, 2)
    assert not outcome.feasible and outcome.reason == Reason.INSUFFICIENT_CAPACITY
    assert outcome.message.startswith("waiting for room on the nodes of Kueue's topology assignment")


def test_lost_assigned_says_why_each_assigned_node_is_unusable() -> None:
    # the operator's inventory leaves avoided nodes out, as it does gone ones
    inventory = _inventory(not_ready=("n1",), gone=("n0", "n2"), cordoned=("n3",))
    assert lost_assigned(inventory, ASSIGNED, avoided=frozenset({"n0"})) == {
        "n0": "avoided: it failed this job's pods", "n1": "not Ready",
        "n2": "no longer in the cluster", "n3": "unschedulable (cordoned)",
    }
    assert lost_assigned(_inventory(pods=(_foreign_pod("n2", 2),)), ASSIGNED) == {}, \
        "a node whose GPUs are taken is not lost"


# --- the Workload: handed back as Kueue evicts one whose node failed ---------------------------


def _workload(hosts: tuple[str, ...] = OURS) -> dict[str, Any]:
    """The job's Workload admitted by Kueue with a topology assignment down to the node."""
    ok = {"status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z", "message": "ok"}
    return {
        "metadata": {"name": "trainingjob-job", "namespace": "ns", "generation": 1, "resourceVersion": "41"},
        "spec": {"queueName": "q", "podSets": [{"name": "workers", "count": len(hosts)}]},
        "status": {
            "admission": {"clusterQueue": "team-a", "podSetAssignments": [{
                "name": "workers", "flavors": {"nvidia.com/gpu": "h100"}, "count": len(hosts),
                "topologyAssignment": {"levels": [HOST],
                                       "domains": [{"values": [h], "count": 1} for h in hosts]},
            }]},
            "conditions": [{"type": "QuotaReserved", "reason": "QuotaReserved", **ok},
                           {"type": "Admitted", "reason": "Admitted", **ok}],
            "unhealthyNodes": [{"name": "n1"}],
        },
    }


def _merged(workload: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch of the status as the API server applies it (lists replaced whole)."""
    status = {**workload["status"], **patch["status"]}
    return {**workload, "status": {k: v for k, v in status.items() if v is not None}}


def test_the_hand_back_evicts_the_workload_as_kueue_does_and_its_release_requeues_it() -> None:
    message = "node n1 (not Ready) of Kueue's topology assignment is lost ..."
    workload = _workload()
    patch = hand_back_status(workload, message, "2026-01-01T00:05:00Z")
    assert patch["metadata"] == {"resourceVersion": "41"}, "refused if Kueue changed the Workload meanwhile"
    evicted = _merged(workload, patch)
    conditions = {c["type"]: c for c in evicted["status"]["conditions"]}
    assert conditions["Evicted"]["status"] == "True" and conditions["Evicted"]["reason"] == NODE_FAILURES
    assert conditions["Admitted"]["status"] == "True", "the admission stays until the gang is gone"
    assert "unhealthyNodes" not in evicted["status"]
    held = gate(evicted, cluster_queue="team-a")
    assert held.evicted and held.holds and "n1 (not Ready)" in held.message
    released = _merged(evicted, release_status(evicted, "2026-01-01T00:05:30Z"))
    after = {c["type"]: c for c in released["status"]["conditions"]}
    assert "admission" not in released["status"]
    assert after["Requeued"]["status"] == "True", "Kueue queues it again at once"
    assert after["QuotaReserved"]["status"] == "False" and after["Admitted"]["status"] == "False"


# --- the reconciler's passes -----------------------------------------------------------------


def _observed(queue_workload: Mapping[str, Any], inventory: Inventory, **kw: Any) -> Observed:
    hosts = assigned_hosts(queue_workload, HOST)
    assert hosts is not None
    nodes = {n: NodeView(n, ready=n in inventory.nodes) for n in OURS + THEIRS}
    base: dict[str, Any] = dict(
        name="job", namespace="ns", generation=1, spec=_spec(), status=TrainingJobStatus(), pods=(),
        nodes=nodes, planner=_within(_spec(), inventory, hosts), now=T0,
        checkpoint=CheckpointView(step=200, uri="s3://ckpt/runs/ns/job/step-0000000200"),
        queue=gate(queue_workload, cluster_queue="team-a"),
    )
    base.update(kw)
    return Observed(**base)


def _condition(status: TrainingJobStatus, kind: str) -> tuple[str, str, str]:
    cond = status.condition(kind)
    assert cond is not None
    return cond.status, cond.reason, cond.message


@pytest.mark.parametrize("lost", ["not_ready", "gone"])
def test_a_restart_that_lost_a_node_of_its_assignment_is_handed_back_and_runs_where_kueue_assigns_next(
    lost: str,
) -> None:
    workload = _workload()
    _, obs = run(_observed(workload, _inventory()))
    d, obs = run(obs, pods=gang(0))
    assert d.status.phase == "Running"
    # 1. n1 fails: the gang does not fit on the rest of its assignment, and the other workload's
    #    nodes are free-looking but promised: hand the job back, create nothing.
    broken = _inventory(not_ready=("n1",)) if lost == "not_ready" else _inventory(gone=("n1",))
    d, obs = run(replace(_observed(workload, broken), status=obs.status), pods=gang(0))
    why = "n1 (not Ready)" if lost == "not_ready" else "n1 (no longer in the cluster)"
    assert d.launch is None and d.hand_back is not None and why in d.hand_back
    assert sorted(d.delete) == [f"job-0-{i}" for i in range(4)]
    assert d.status.restarts == 1 and d.status.phase == "Recovering"
    admitted = _condition(d.status, C.ADMITTED)
    assert admitted[:2] == ("False", Reason.HANDED_BACK) and admitted[2] == d.hand_back
    assert "handed back to Kueue for a new topology assignment" in (d.status.message or "")
    assert (("Warning", Reason.HANDED_BACK, d.hand_back)) in d.events
    # 2. The Workload is evicted (the operator's patch): the job is Suspended saying why; the pod
    #    left Terminating on the lost node does not hold the quota back.
    evicted = _merged(workload, hand_back_status(workload, d.hand_back, "2026-01-01T00:00:05Z"))
    stuck = (PodView("job-0-1", 1, 0, phase="Running", node="n1", terminating=True),)
    d, obs = run(replace(_observed(evicted, broken), status=obs.status), pods=stuck)
    assert d.status.phase == "Suspended" and d.release_quota and d.launch is None and d.hand_back is None
    assert why in _condition(d.status, C.SUSPENDED)[2]
    # 3. Kueue admits it again with a new assignment (n1 replaced by m0): it resumes there, from
    #    the newest commit, without another restart charged.
    again = _workload(("n0", "n2", "n3", "m0"))
    d, obs = run(replace(_observed(again, broken), status=obs.status), pods=())
    assert d.launch is not None and d.launch.resume_step == 200
    assert set(d.launch.assignments.values()) == {"n0", "n2", "n3", "m0"}
    assert d.status.restarts == 1 and _condition(d.status, C.ADMITTED)[:2] == ("True", Reason.KUEUE_ADMITTED)
