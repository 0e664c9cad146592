"""spec.suspend: a running gang checkpoints first, then stops; false resumes it from the newest
commit as a new attempt; neither is a failure (pure reconcile, the planner a table fake)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from test_reconcile import gang, observed, run, running_job, spec
from test_reconcile_planned import LAST, asked, at, request_of, served
from topotrain.api.status import ConditionType as C
from topotrain.api.status import Reason
from topotrain.core.decision import Observed
from topotrain.core.planned import CHECKPOINT_REQUEST_TIMEOUT
from topotrain.core.reconcile_status import CheckpointView


def suspended_spec(on: bool = True) -> Any:
    s = spec()
    s.suspend = on
    return s


def _cond(d: Any, type_: str) -> tuple[str, str]:
    cond = d.status.condition(type_)
    assert cond is not None
    return cond.status, cond.reason


def test_suspend_checkpoints_the_running_gang_then_stops_it_and_resume_starts_from_that_step() -> None:
    obs = replace(running_job(), spec=suspended_spec())
    pods = gang(0)
    # 1. Asked for a checkpoint; the gang keeps training meanwhile.
    d, obs = run(obs, pods=pods, now=at(10))
    value = request_of(d)
    assert value.startswith("suspend-0-") and d.checkpoint_request is not None
    assert not d.delete and d.launch is None and d.status.phase == "Running"
    assert _cond(d, C.SUSPENDED) == ("False", Reason.SUSPENDING)
    assert d.status.reason == Reason.SUSPENDING
    # 2. Committed: every pod deleted, the attempt moves on, the job is Suspended.
    d, obs = run(obs, pods=asked(pods, value), now=at(14), checkpoint=served(value, 237))
    assert sorted(d.delete) == sorted(p.name for p in pods) and d.launch is None
    assert d.status.phase == "Suspended" and d.status.attempt == 1 and d.status.restarts == 0
    assert _cond(d, C.SUSPENDED) == ("True", Reason.SUSPENDED)
    assert d.status.reason == Reason.SUSPENDED and "step 237" in (d.status.message or "")
    assert Reason.SUSPENDED in [e[1] for e in d.events]
    # 3. Suspended, the old pods going: nothing is created, no second Event.
    terminating = tuple(replace(p, terminating=True) for p in asked(pods, value))
    d, obs = run(obs, pods=terminating, now=at(20), checkpoint=served(value, 237))
    assert d.launch is None and not d.delete and d.status.phase == "Suspended"
    assert Reason.SUSPENDED not in [e[1] for e in d.events]
    d, obs = run(obs, pods=(), now=at(30), checkpoint=served(value, 237))
    assert d.launch is None and d.status.phase == "Suspended"
    # 4. Resumed: a new attempt from the newest commit (here the SIGTERM save, newer still).
    newest = replace(served(value, 237), step=240, uri="s3://ckpt/runs/ns/job/step-0000000240")
    d, obs = run(replace(obs, spec=suspended_spec(False)), pods=(), now=at(100), checkpoint=newest)
    assert d.launch is not None and d.launch.attempt == 1 and d.launch.resume_step == 240
    assert d.status.phase == "Recovering" and d.status.restarts == 0
    assert d.status.recovery is not None and d.status.recovery.cause == "resume"
    assert _cond(d, C.SUSPENDED) == ("False", Reason.RESUMED)
    assert Reason.RESUMED in [e[1] for e in d.events]
    # 5. Its pods Running: the job is Running again.
    d, _ = run(obs, pods=gang(1), now=at(105), checkpoint=newest)
    assert d.status.phase == "Running"
    assert d.status.reason != Reason.RESUMED, "a Running job says why it runs, not that it resumed"


def test_suspend_falls_back_to_the_last_commit_when_the_checkpoint_never_comes() -> None:
    obs = replace(running_job(), spec=suspended_spec())
    d, obs = run(obs, pods=gang(0), now=at(10))
    value = request_of(d)
    d, _ = run(obs, pods=asked(gang(0), value), now=at(10 + 121), checkpoint=LAST)
    assert len(d.delete) == 4 and d.status.phase == "Suspended" and d.status.attempt == 1
    assert Reason.CHECKPOINT_TIMED_OUT in [e[1] for e in d.events]


def test_a_gang_not_running_yet_is_stopped_at_once() -> None:
    _, obs = run(observed())
    obs = replace(obs, spec=suspended_spec())
    d, _ = run(obs, pods=gang(0, phase="Pending", gated=True))
    assert len(d.delete) == 4 and not d.release and d.checkpoint_request is None
    assert d.status.phase == "Suspended" and d.status.attempt == 1


def test_a_job_created_suspended_creates_nothing_until_resumed() -> None:
    d, obs = run(observed(spec=suspended_spec()))
    assert d.launch is None and d.status.phase == "Suspended" and d.status.attempt == 0
    d, _ = run(replace(obs, spec=suspended_spec(False)))
    assert d.launch is not None and d.launch.attempt == 0 and d.status.phase == "Starting"


def test_suspend_without_a_checkpoint_store_stops_at_once() -> None:
    s = suspended_spec()
    s.checkpoint = None
    obs: Observed = replace(running_job(), spec=s, checkpoint=None)
    d, _ = run(obs, pods=gang(0))
    assert len(d.delete) == 4 and d.status.phase == "Suspended"


def test_a_failed_pod_of_a_suspended_job_is_no_failure() -> None:
    obs = replace(running_job(), spec=suspended_spec())
    d, obs = run(obs, pods=gang(0), now=at(10))
    pods = list(asked(gang(0), request_of(d)))
    pods[2] = replace(pods[2], phase="Failed", exit_code=1)
    d, _ = run(obs, pods=tuple(pods), now=at(12))
    assert d.status.restarts == 0 and d.status.phase == "Suspended"


def test_suspend_is_bounded_while_the_store_is_unreadable() -> None:
    """spec.suspend waits for its checkpoint no longer than the bound, store readable or not
    (a resize, the job's own change, still waits: test_reconcile_planned)."""
    down = CheckpointView(reachable=False, error="Could not connect to the endpoint URL")
    obs = replace(running_job(), spec=suspended_spec())
    d, obs = run(obs, pods=gang(0), now=at(10), checkpoint=down)
    value = request_of(d)
    assert not d.delete and d.status.phase == "Running"
    d, _ = run(obs, pods=asked(gang(0), value), now=at(10 + CHECKPOINT_REQUEST_TIMEOUT + 1),
               checkpoint=down)  # fmt: skip
    assert len(d.delete) == 4 and d.status.phase == "Suspended" and d.status.attempt == 1
    assert Reason.CHECKPOINT_TIMED_OUT in [e[1] for e in d.events]
