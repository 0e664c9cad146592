"""Invariant 14 (testbed/chaos/checkers_kueue.py) and the soak's Kueue objects
(testbed/chaos/queued.py), on hand-written histories and manifests: an eviction whose quota
comes back within the bound holds; one held past it is named; time without an acting
operator is allowed for; a soak without Kueue judges nothing."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

from testbed.chaos.catalogue import NEEDS_KUEUE, Kind, schedule
from testbed.chaos.checkers_kueue import check_eviction_bound, evictions
from testbed.chaos.queued import QUOTA, preemptor, queue_labels, queues, workload_record
from testbed.chaos.timeline import Timeline

NS = "chaos-x"
T0 = 1_000_000.0


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def workload(job: str, reserved: bool, evicted_at: float | None, reserved_change: float) -> dict[str, Any]:
    conditions = [("QuotaReserved", "True" if reserved else "False", "x", iso(reserved_change))]
    if evicted_at is not None:
        conditions.append(("Evicted", "True", "Preempted", iso(evicted_at)))
    return {"name": f"trainingjob-{job}", "job": job, "admitted": reserved, "conditions": conditions}


def api(t: float, workloads: list[dict[str, Any]]) -> dict[str, Any]:
    return {"t": t, "type": "api", "pods": [], "jobs": [], "nodes": {}, "workloads": workloads}


def history(released_after: float, kueue: bool = True, away: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    """Job q is admitted, evicted at T0 + 100 and gives its quota back `released_after` s later."""
    evicted, released = T0 + 100, T0 + 100 + released_after
    records: list[dict[str, Any]] = [
        {"t": T0, "type": "soak-start", "namespace": NS, "kueue": kueue, "checkpoint_request_timeout": 120.0},
        api(T0 + 50, [workload("q", True, None, T0 + 40)]),
        api(T0 + 102, [workload("q", True, evicted, T0 + 40)]),
        api(released + 2, [workload("q", False, evicted, released)]),
    ]  # fmt: skip
    if away is not None:
        records += [{"t": away[0], "type": "fault", "index": 9, "kind": Kind.OPERATOR_KILL.value, "jobs": ["q"]},
                    {"t": away[1], "type": "heal", "index": 9, "kind": Kind.OPERATOR_KILL.value}]  # fmt: skip
    return sorted(records, key=lambda r: r["t"])


def judge(records: list[dict[str, Any]]) -> Any:
    return check_eviction_bound(Timeline.of(records, NS), records)


def test_an_eviction_whose_quota_comes_back_in_time_holds() -> None:
    found = judge(history(released_after=40))
    assert found.ok and found.checked == 1, found.line()
    assert evictions(Timeline.of(history(40), NS)) == [("q", T0 + 100, T0 + 140)]


def test_quota_held_past_the_checkpoint_bound_is_a_violation() -> None:
    found = judge(history(released_after=400))
    assert not found.ok and "gave its quota back after 400s" in found.details[0]


def test_quota_never_given_back_is_a_violation() -> None:
    records = [*history(released_after=400)[:-1], api(T0 + 600, [workload("q", True, T0 + 100, T0 + 40)])]
    found = judge(records)
    assert not found.ok and "still held its quota" in found.details[0]


def test_time_without_an_acting_operator_is_allowed_for() -> None:
    found = judge(history(released_after=300, away=(T0 + 110, T0 + 250)))
    assert found.ok, found.line()


def test_a_soak_without_kueue_judges_nothing() -> None:
    found = judge(history(released_after=400, kueue=False))
    assert found.ok and found.checked == 0


def test_kueue_preempt_is_drawn_only_where_kueue_runs() -> None:
    assert Kind.KUEUE_PREEMPT in NEEDS_KUEUE
    plan = schedule(11, 300, 1.0, {Kind.KUEUE_PREEMPT, Kind.POD_DELETED})
    preempts = [f for f in plan if f.kind == Kind.KUEUE_PREEMPT]
    assert preempts and all(a.at + a.duration <= b.at for a, b in itertools.pairwise(preempts))


def test_the_preemptor_outranks_the_queued_jobs_in_their_own_queue() -> None:
    body = preemptor("preemptor-0001", NS, QUOTA)
    assert body["spec"]["queueName"] == queue_labels(NS)["kueue.x-k8s.io/queue-name"]
    assert body["spec"]["priority"] > 0 and body["spec"]["podSets"][0]["count"] == QUOTA
    objects = queues(NS).manifests()
    cq = next(o for o in objects if o["kind"] == "ClusterQueue")
    assert cq["spec"]["preemption"] == {"withinClusterQueue": "LowerPriority"}
    quota = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"]
    assert quota == str(QUOTA)


def test_the_observer_keeps_a_workloads_owner_and_condition_times() -> None:
    raw = {"metadata": {"name": "trainingjob-q", "ownerReferences": [{"kind": "TrainingJob", "name": "q"}]},
           "status": {"admission": {"clusterQueue": "c"}, "conditions": [
               {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                "lastTransitionTime": "2026-12-06T10:00:00Z"}]}}  # fmt: skip
    record = workload_record(raw)
    assert record["job"] == "q" and record["admitted"]
    assert record["conditions"] == [("QuotaReserved", "True", "QuotaReserved", "2026-12-06T10:00:00Z")]
    assert record["gpus"] == 0  # (no spec: nothing asked)


def test_a_workloads_gpus_are_its_pod_sets_counts_times_their_requests() -> None:
    # the preemptor's size is set from what the holders hold, read from their Workloads
    assert workload_record(preemptor("p", NS, 5))["gpus"] == 5
    two = {"metadata": {"name": "w"}, "spec": {"podSets": [
        {"count": 2, "template": {"spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "4"}}},
                                                          {"resources": {}}]}}},
        {"count": 3, "template": {"spec": {"containers": [{"resources": {"requests": {"cpu": "1"}}}]}}}]}}  # fmt: skip
    assert workload_record(two)["gpus"] == 8
