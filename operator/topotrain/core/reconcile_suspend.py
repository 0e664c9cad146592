"""A gang that must not run: spec.suspend, or Kueue holding or evicting the job.

Either way the running gang stops without losing a step (a checkpoint first, planned.py)
and the job keeps its place; `admission` sets the Admitted condition from Kueue's word.
"""

from __future__ import annotations

from topotrain.api.status import Reason
from topotrain.core import planned, policy
from topotrain.core.decision import Decision, Observed
from topotrain.core.kueue_admission import QueueGate
from topotrain.core.reconcile_status import StatusBuilder

# Phases in which the current attempt has had pods (a job Pending or already Suspended has not).
HAD_A_GANG = ("Starting", "Running", "Suspending")


def suspend(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], why: str = "spec.suspend", reason: str = Reason.SUSPENDED,
    then: str = "false resumes it from the newest commit", cause: str = "suspend",
) -> None:
    """spec.suspend: stop the gang and keep the job, losing no step.

    A Running gang is asked for a checkpoint first (planned.py, as for a resize) and keeps
    training until it is committed (or the request's bound passed); then its pods are deleted
    (their trainers also save on SIGTERM) and the attempt moves on, so the gang that resumes is
    a new attempt from the newest commit. A gang not Running yet is deleted at once.
    """
    live = [p for p in current if not p.terminating]
    step = None if obs.checkpoint is None else obs.checkpoint.step
    wait = planned.stop_saving(sb, obs.checkpoint, current, live, attempt, cause, obs.now,
                               obs.checkpoint_request_timeout)
    if not wait.ready:
        decision.checkpoint_request, decision.requeue_after = wait.ask, wait.requeue_after
        sb.suspending(attempt, why)
        return
    step = wait.resume_step if wait.resume_step is not None else step
    decision.relabel, decision.release = None, []
    if live:
        decision.delete += [p.name for p in live if p.name not in decision.delete]
    if live or current or sb.status.phase in HAD_A_GANG:
        # The attempt had a gang, even one whose pods were all gone by this pass (deleted,
        # crashed, collected with a lost node while the stop waited for its checkpoint): the gang
        # that resumes is the next attempt, never a second gang under a number already Running.
        sb.at_attempt(attempt + 1)
    sb.suspended(step, len(live), why, reason, then)


def admission(obs: Observed, sb: StatusBuilder, queue: QueueGate) -> None:
    """The Admitted condition from Kueue's decision."""
    if queue.evicted:
        sb.admission(False, Reason.EVICTED, queue.message)
    elif queue.admitted:
        sb.admission(True, Reason.KUEUE_ADMITTED, queue.message)
    else:
        sb.admission(False, Reason.WAITING_FOR_ADMISSION, queue.message)


def hold_for_queue(
    obs: Observed, sb: StatusBuilder, decision: Decision, attempt: int,
    current: list[policy.PodView], queue: QueueGate,
) -> None:
    """Kueue has not admitted the job, or evicted it: no gang runs.

    A job that never ran waits Pending. An evicted gang stops as for spec.suspend (a
    checkpoint first, then its pods go), the job is Suspended until Kueue admits it again,
    and once none of its pods is left the quota is given back, so Kueue requeues it (and
    the preemptor's pods do not wait for GPUs still held).
    """
    if current or sb.status.start_time or sb.status.phase == "Suspended":
        # Kueue's words say why (a preemption, or the job handed back after losing a node)
        why = queue.message if queue.evicted and queue.message else "evicted by Kueue"
        suspend(obs, sb, decision, attempt, current, why=why,
                 reason=Reason.EVICTED, cause="evict", then="it resumes from the newest commit once Kueue "
                 "admits it again")
