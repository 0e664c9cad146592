"""Under Kueue (reconcile's QueueGate, pure; the planner a table fake): a job waits for admission
with a condition naming the ClusterQueue, starts once admitted, and when evicted checkpoints and
stops like spec.suspend, gives the quota back only once its pods are gone, and resumes from that
checkpoint when readmitted."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from test_reconcile import gang, observed, run, running_job
from test_reconcile_planned import asked, at, request_of, served
from test_reconcile_suspend import suspended_spec
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.core.kueue_admission import QueueGate
from topotrain.core.planned import CHECKPOINT_REQUEST_TIMEOUT
from topotrain.core.reconcile_status import CheckpointView

WAITING = QueueGate(admitted=False, message=(
    "waiting for Kueue admission in ClusterQueue team-a: couldn't assign flavors to pod set "
    "workers: insufficient unused quota for nvidia.com/gpu in flavor h100, 8 more needed"))
ADMITTED = QueueGate(admitted=True, message="admitted by Kueue in ClusterQueue team-a (flavor h100, 4 pods)")
EVICTED = QueueGate(admitted=True, evicted=True, reason="Preempted", message=(
    "evicted by Kueue from ClusterQueue team-a (Preempted: Preempted to accommodate a workload "
    "due to prioritization in the ClusterQueue)"))


def _cond(d: Any, type_: str) -> tuple[str, str]:
    cond = d.status.condition(type_)
    assert cond is not None
    return cond.status, cond.reason


def test_a_job_waits_for_admission_naming_the_cluster_queue_then_starts() -> None:
    d, obs = run(replace(observed(), queue=WAITING))
    assert d.launch is None and not d.delete and d.status.phase == "Pending"
    assert _cond(d, C.ADMITTED) == ("False", Reason.WAITING_FOR_ADMISSION)
    assert d.status.reason == Reason.WAITING_FOR_ADMISSION
    assert "ClusterQueue team-a" in (d.status.message or "") and "8 more needed" in (d.status.message or "")
    assert not d.release_quota
    d, _ = run(replace(obs, queue=ADMITTED))
    assert d.launch is not None and d.launch.attempt == 0 and len(d.launch.assignments) == 4
    assert _cond(d, C.ADMITTED) == ("True", Reason.KUEUE_ADMITTED)


def test_an_evicted_gang_checkpoints_stops_gives_back_its_quota_and_resumes_when_readmitted() -> None:
    obs = replace(running_job(), queue=EVICTED)
    pods = gang(0)
    # 1. Evicted while Running: a checkpoint first, the gang keeps training meanwhile.
    d, obs = run(obs, pods=pods, now=at(10))
    value = request_of(d)
    assert value.startswith("evict-0-") and not d.delete and d.status.phase == "Running"
    assert _cond(d, C.ADMITTED) == ("False", Reason.EVICTED)
    assert not d.release_quota, "the gang still runs: Kueue must not hand its GPUs on yet"
    # 2. Committed: every pod deleted, the job Suspended saying why; the quota is still held.
    d, obs = run(obs, pods=asked(pods, value), now=at(14), checkpoint=served(value, 311))
    assert sorted(d.delete) == sorted(p.name for p in pods) and d.launch is None
    assert d.status.phase == "Suspended" and d.status.attempt == 1 and d.status.restarts == 0
    assert _cond(d, C.SUSPENDED) == ("True", Reason.EVICTED)
    assert "evicted by Kueue" in (d.status.message or "") and "step 311" in (d.status.message or "")
    assert not d.release_quota
    # 3. Pods terminating: still held. 4. Gone: the quota goes back.
    terminating = tuple(replace(p, terminating=True) for p in asked(pods, value))
    d, obs = run(obs, pods=terminating, now=at(20), checkpoint=served(value, 311))
    assert not d.release_quota and d.launch is None
    d, obs = run(obs, pods=(), now=at(25), checkpoint=served(value, 311))
    assert d.release_quota and d.launch is None and d.status.phase == "Suspended"
    # 5. Requeued, not admitted yet: it waits, Suspended, creating nothing.
    d, obs = run(replace(obs, queue=WAITING), pods=(), now=at(40), checkpoint=served(value, 311))
    assert d.launch is None and d.status.phase == "Suspended" and not d.release_quota
    assert _cond(d, C.ADMITTED) == ("False", Reason.WAITING_FOR_ADMISSION)
    # 6. Readmitted: a new attempt from the checkpoint the eviction asked for.
    d, obs = run(replace(obs, queue=ADMITTED), pods=(), now=at(90), checkpoint=served(value, 311))
    assert d.launch is not None and d.launch.attempt == 1 and d.launch.resume_step == 311
    assert d.status.phase == "Recovering" and d.status.restarts == 0
    assert _cond(d, C.SUSPENDED) == ("False", Reason.RESUMED)
    assert "admitted by Kueue in ClusterQueue team-a" in _message(d, C.SUSPENDED)


def test_a_gang_gone_while_its_eviction_waited_resumes_as_the_next_attempt() -> None:
    """The soak with Kueue (seed 1001): evicted while Running, the gang's pods all went (one
    deleted, the other crashed) before it committed; the readmitted gang was created under the
    attempt number that had already been Running. It is the next attempt."""
    obs = replace(running_job(), queue=EVICTED)
    pods = gang(0)
    d, obs = run(obs, pods=pods, now=at(10))
    value = request_of(d)
    assert d.status.phase == "Running" and d.status.attempt == 0
    d, obs = run(obs, pods=(), now=at(40))  # every pod gone before the checkpoint came
    assert d.status.phase == "Suspended" and d.status.attempt == 1 and d.status.restarts == 0
    assert d.release_quota, value
    d, _ = run(replace(obs, queue=ADMITTED), pods=(), now=at(90))
    assert d.launch is not None and d.launch.attempt == 1, "never a second gang under attempt 0"


def test_a_gang_evicted_before_it_runs_stops_at_once() -> None:
    _, obs = run(replace(observed(), queue=ADMITTED))
    d, _ = run(replace(obs, queue=EVICTED), pods=gang(0, phase="Pending", gated=True))
    assert len(d.delete) == 4 and not d.release and d.checkpoint_request is None
    assert d.status.phase == "Suspended" and not d.release_quota


def test_spec_suspend_under_kueue_stops_the_gang_and_gives_back_the_evicted_quota() -> None:
    """spec.suspend deactivates the Workload; Kueue evicts it; the quota goes back once no pod is left."""
    obs = replace(running_job(), spec=suspended_spec(), queue=EVICTED)
    d, obs = run(obs, pods=(), now=at(30))
    assert d.status.phase == "Suspended" and d.release_quota
    assert _cond(d, C.SUSPENDED) == ("True", Reason.SUSPENDED)


def _message(d: Any, type_: str) -> str:
    cond = d.status.condition(type_)
    return cond.message if cond is not None else ""


# --- the handlers' side: TAS pods marked (planning on Kueue's assignment: test_kueue_recovery.py) ---


def test_pods_on_kueues_assigned_nodes_carry_the_tas_annotation_and_others_do_not() -> None:
    from test_reconcile import spec
    from topotrain.controller.act import Actuator
    from topotrain.controller.settings import Settings
    from topotrain.controller.snapshot import Ledger
    from topotrain.core.decision import Launch
    from topotrain.core.kueue_admission import TAS_POD_ANNOTATION
    from topotrain.core.manifests import JobMeta

    actuator = Actuator(kube=None, settings=Settings(), ledger=Ledger())  # type: ignore[arg-type]
    actuator.tas_hosts = frozenset({"a"})
    launch = Launch(attempt=0, data=2, pool="H100-80GB", assignments={0: "a", 1: "b"},
                    resume_step=None, mode="initial")
    pods = actuator._manifests(JobMeta("llm", "team", "uid"), spec(), launch)
    marked = [TAS_POD_ANNOTATION in p["metadata"].get("annotations", {}) for p in pods]
    assert marked == [True, False], "pod 0 is on Kueue's node a, pod 1 on b"


def test_an_eviction_is_not_held_up_by_an_unreadable_store_past_the_bound() -> None:
    """A tenant whose store is down (or who deleted its credentials Secret) cannot make its job
    unpreemptible: past the request's bound the gang stops and the quota goes back anyway."""
    down = CheckpointView(reachable=False, error="Secret team-a/s3 not found")
    obs = replace(running_job(), queue=EVICTED)
    pods = gang(0)
    d, obs = run(obs, pods=pods, now=at(10), checkpoint=down)
    value = request_of(d)
    assert not d.delete and not d.release_quota and d.status.phase == "Running"
    # within the bound it still waits for the checkpoint it asked for
    d, obs = run(obs, pods=asked(pods, value), now=at(10 + CHECKPOINT_REQUEST_TIMEOUT - 5),
                 checkpoint=down)  # fmt: skip
    assert not d.delete and d.requeue_after is not None and d.requeue_after <= 5
    # past it: stopped, Suspended, and once the pods are gone the quota is released
    d, obs = run(obs, pods=asked(pods, value), now=at(10 + CHECKPOINT_REQUEST_TIMEOUT + 1),
                 checkpoint=down)  # fmt: skip
    assert sorted(d.delete) == sorted(p.name for p in pods)
    assert d.status.phase == "Suspended" and d.status.attempt == 1 and d.status.restarts == 0
    timed_out = [e for e in d.events if e[1] == Reason.CHECKPOINT_TIMED_OUT]
    assert timed_out and "unreadable" in timed_out[0][2] and "Secret team-a/s3 not found" in timed_out[0][2]
    assert d.status.checkpoint_request is not None and d.status.checkpoint_request.state == "TimedOut"
    d, _ = run(obs, pods=(), now=at(10 + CHECKPOINT_REQUEST_TIMEOUT + 5), checkpoint=down)
    assert d.release_quota and d.launch is None
