"""Planned changes lose no step: checkpoint the running gang first, then change it.

A resize (`kubectl scale`, a grow when capacity returns) used to delete the gang at
once and resume from the last commit, throwing away up to a checkpoint interval.
Now the reconciler first asks for a checkpoint: a new value of the pods'
`topotrain.io/checkpoint-request` annotation (the trainer reads it through its
downwardAPI control file, saves at the next step boundary and keeps training).
Once the newest COMMITTED names that value, the change goes ahead and resumes
from that step. The wait is bounded by CHECKPOINT_REQUEST_TIMEOUT (the operator's
TOPOTRAIN_CHECKPOINT_REQUEST_TIMEOUT): a trainer that does not serve requests, or a
save that takes longer, falls back to the last commit, with a Warning Event; 0
turns the request off.

Pure: the request's state lives in `status.checkpointRequest`, the clock is the
pass's `now`, and the annotation is (re)applied to every pod that lacks it, so an
operator restart at any line neither loses the request nor asks twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from topotrain.api.status import CheckpointRequestStatus
from topotrain.contract import planned_stop_request
from topotrain.core import policy
from topotrain.core.reconcile_status import CheckpointView, StatusBuilder
from topotrain.core.status_edits import iso

# Seconds a planned change waits for the checkpoint it asked for. The bundled trainer saves at
# its next step boundary; a step plus a save of the testbed's models takes a few seconds, and a
# large model's save should still fit. Past it the change resumes from the last commit.
CHECKPOINT_REQUEST_TIMEOUT = 120.0
POLL_SECONDS = 2.0  # how often a pass looks for the requested COMMITTED while waiting
# Stops that another party waits for: their bound holds even while the store is unreadable.
BOUNDED_WHATEVER_THE_STORE = frozenset({"evict", "suspend", "deadline"})


@dataclass(frozen=True)
class CheckpointAsk:
    """Set `value` as the checkpoint-request annotation of these pods (a merge patch)."""

    pods: tuple[str, ...]
    value: str


@dataclass(frozen=True)
class Wait:
    """Whether the planned change may go ahead now, and what to do meanwhile."""

    ready: bool
    ask: CheckpointAsk | None = None
    requeue_after: float | None = None
    # The step the change resumes from when its checkpoint was served (None: the last commit).
    resume_step: int | None = None


def pending(status_request: CheckpointRequestStatus | None) -> bool:
    return status_request is not None and status_request.state == "Pending"


def checkpoint_first(
    sb: StatusBuilder, view: CheckpointView | None, pods: list[policy.PodView], attempt: int,
    reason: str, now: datetime, timeout: float = CHECKPOINT_REQUEST_TIMEOUT,
) -> Wait:
    """Ask for a checkpoint of `attempt` (once), then report ready when it is committed.

    Ready at once without a checkpoint store (nothing could be saved), and with `timeout` 0
    (checkpoint-on-demand turned off: the change resumes from the last commit, as before it
    existed). While the store is unreadable a change of the job's own (a resize, a roll, a
    drain) waits rather than guess the resume step; a stop that someone else waits for (a
    Kueue eviction, `spec.suspend`) gets no more than `timeout` whatever the store's state: a
    job whose store is down, or whose credentials Secret its tenant deleted, must not keep its
    GPUs and its quota for ever. Its trainers' SIGTERM save still runs; the resume step is read
    from the store when the job starts again.
    """
    if view is None or timeout <= 0:
        cancel(sb)  # a request made before the operator's setting changed is not waited for
        return Wait(ready=True)
    req = sb.status.checkpoint_request
    if not pending(req) or req is None or req.attempt != attempt:
        req = CheckpointRequestStatus(value=planned_stop_request(reason, attempt, iso(now)), reason=reason,
                                      attempt=attempt, time=iso(now))  # fmt: skip
        sb.checkpoint_asked(req, f"{reason}: asked attempt {attempt} for a checkpoint at its next "
                            f"step (waits up to {timeout:.0f}s, then resumes from the last commit)")
    waited = (now - sb.parse(req.time)).total_seconds()
    if not view.reachable:
        if reason in BOUNDED_WHATEVER_THE_STORE and waited >= timeout:
            sb.checkpoint_timed_out(req.step, (
                f"{reason}: the checkpoint asked {int(waited)}s ago cannot be seen, the checkpoint "
                f"store is unreadable ({view.error or 'no answer'}); stopping the gang anyway "
                f"(bound {timeout:.0f}s): it resumes from the newest commit the store holds when it "
                "starts again"))
            return Wait(ready=True)
        wait = POLL_SECONDS if reason not in BOUNDED_WHATEVER_THE_STORE else min(POLL_SECONDS, timeout - waited)
        return Wait(ready=False, ask=_ask(req, pods), requeue_after=wait)
    if view.request == req.value and view.request_step is not None:
        sb.checkpoint_served(view.request_step,
                             f"{reason}: checkpoint of step {view.request_step} committed; changing the gang")
        return Wait(ready=True, resume_step=view.request_step)
    if waited >= timeout:
        last = "from scratch" if view.step is None else f"from the last commit, step {view.step}"
        sb.checkpoint_timed_out(view.step, f"{reason}: the checkpoint asked {int(waited)}s ago is not "
                                f"committed (bound {timeout:.0f}s); resuming {last}")
        return Wait(ready=True)
    return Wait(ready=False, ask=_ask(req, pods), requeue_after=min(POLL_SECONDS, timeout - waited))


def stop_saving(
    sb: StatusBuilder, view: CheckpointView | None, pods: list[policy.PodView],
    live: list[policy.PodView], attempt: int, reason: str, now: datetime, timeout: float,
) -> Wait:
    """A gang stopped for good (suspend, a deadline): a Running gang saves first
    (`checkpoint_first`); one not Running yet has nothing to save, so a pending request is
    cancelled and the stop goes ahead at once."""
    if sb.status.phase == "Running" and live and all(p.phase == "Running" for p in live):
        return checkpoint_first(sb, view, pods, attempt, reason, now, timeout)
    cancel(sb)
    return Wait(ready=True)


def cancel(sb: StatusBuilder) -> None:
    """The planned change is no longer wanted, or something else changed the gang first.

    A checkpoint the trainer still saves is harmless: an ordinary commit.
    """
    if pending(sb.status.checkpoint_request):
        sb.checkpoint_cancelled()


def settle(sb: StatusBuilder) -> None:
    """A pending request of an attempt that is no longer current (a failure or a rollout
    restarted the gang), or of a job that finished, is cancelled."""
    req, st = sb.status.checkpoint_request, sb.status
    if pending(req) and req is not None and (req.attempt != st.attempt
                                            or st.phase in ("Succeeded", "Failed")):
        sb.checkpoint_cancelled()


def release(sb: StatusBuilder, pods: list[policy.PodView]) -> CheckpointAsk | None:
    """A request called off (Cancelled) that pods of the gang still carry: clear it.

    Its value marks a planned stop, so a trainer that served it waits at that step for the
    SIGTERM that is not coming now; the cleared annotation lets it train on.
    """
    req = sb.status.checkpoint_request
    if req is None or req.state != "Cancelled":
        return None
    carrying = tuple(p.name for p in pods if not p.terminating and p.checkpoint_request == req.value)
    return CheckpointAsk(pods=carrying, value="") if carrying else None


def _ask(req: CheckpointRequestStatus, pods: list[policy.PodView]) -> CheckpointAsk | None:
    missing = tuple(p.name for p in pods if not p.terminating and p.checkpoint_request != req.value)
    return CheckpointAsk(pods=missing, value=req.value) if missing else None
