"""spec.activeDeadlineSeconds and spec.ttlSecondsAfterFinished: a job's time limits, pure
(`now` is the pass's input).

- The deadline runs from status.startTime (the first attempt's placement; a job that never
  started has none running), suspended time included. Once it passes, a Running gang is asked
  for a final checkpoint (planned.py, bounded as for spec.suspend: a trainer that serves no
  request is stopped when the bound passes, after its SIGTERM save), then its pods are deleted
  and the job is Failed with reason DeadlineExceeded.
- The time to live runs from status.completionTime: once it passes, the job is deleted, and
  its children (pods, Service, rank table, NetworkPolicy, Workload) with it through their
  owner references. Its checkpoints in the store are kept.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.core import planned, policy
from topotrain.core.decision import Decision, Observed
from topotrain.core.reconcile_status import StatusBuilder
from topotrain.core.status_edits import parse

CAUSE = "deadline"  # the checkpoint request's reason (planned.BOUNDED_WHATEVER_THE_STORE)


def deadline_left(spec: TrainingJobSpec, status: TrainingJobStatus, now: datetime) -> float | None:
    """Seconds until spec.activeDeadlineSeconds passes (<= 0: passed); None: no deadline runs."""
    if spec.active_deadline_seconds is None or not status.start_time:
        return None
    ends = parse(status.start_time) + timedelta(seconds=spec.active_deadline_seconds)
    return (ends - now).total_seconds()


def ttl_left(spec: TrainingJobSpec, status: TrainingJobStatus, now: datetime) -> float | None:
    """Seconds until a finished job is deleted (<= 0: now); None: it is kept."""
    if spec.ttl_seconds_after_finished is None or not status.completion_time:
        return None
    ends = parse(status.completion_time) + timedelta(seconds=spec.ttl_seconds_after_finished)
    return (ends - now).total_seconds()


def _sooner(current: float | None, seconds: float) -> float:
    return seconds if current is None else min(current, seconds)


def expired(obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
            current: list[policy.PodView]) -> bool:
    """True when the deadline has passed and this pass stops the job (it is Failed, or its gang
    saves a final checkpoint first)."""
    left = deadline_left(obs.spec, sb.status, obs.now)
    if left is None or left > 0:
        return False
    limit = obs.spec.active_deadline_seconds
    live = [p for p in current if not p.terminating]
    wait = planned.stop_saving(sb, obs.checkpoint, current, live, attempt, CAUSE, obs.now,
                               obs.checkpoint_request_timeout)
    if not wait.ready:
        decision.checkpoint_request, decision.requeue_after = wait.ask, wait.requeue_after
        return True
    decision.relabel, decision.release, decision.launch = None, [], None
    decision.delete += [p.name for p in live if p.name not in decision.delete]
    sb.failed(Reason.DEADLINE_EXCEEDED,
              f"the job ran longer than spec.activeDeadlineSeconds ({limit}s) since it started "
              f"at {sb.status.start_time}")
    return True


def come_back_by(obs: Observed, sb: StatusBuilder, decision: Decision) -> None:
    """The pass after this one comes by the deadline at the latest."""
    left = deadline_left(obs.spec, sb.status, obs.now)
    if left is not None and left > 0 and sb.status.phase not in ("Succeeded", "Failed"):
        decision.requeue_after = _sooner(decision.requeue_after, left)


def after_finish(obs: Observed, sb: StatusBuilder, decision: Decision) -> None:
    """A finished job's time to live: delete it once it is over, else come back then."""
    left = ttl_left(obs.spec, sb.status, obs.now)
    if left is None:
        return
    if left <= 0:
        decision.delete_job = True
    else:
        decision.requeue_after = _sooner(decision.requeue_after, left)
