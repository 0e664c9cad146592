"""Which committed step a gang resumes from, and why it is that one.

A planned change (a rollout onto a new spec, a resize, a drain: planned.py) asks the
running gang for a checkpoint, stops it once that checkpoint is committed, and starts
the changed gang from that step R. The old gang must not commit later steps before it
stops (the bundled trainer trains no further step after serving a planned stop's
request: docs/trainer.md), but a trainer that does not pause, or a stop that comes
late, may: its periodic saves and its SIGTERM save commit steps after R, trained under
the old spec or degree, that are not the job's history after the change. Resuming a
restart of the new gang from one of them (it crashed before its own first commit)
would silently replace the new spec's work with old-spec steps.

So the change is recorded (`status.plannedRestore`, by `StatusBuilder.restore_floor`: the
first attempt of the changed gang and R), and a commit is resumable only when it is at or below R or was saved by
that attempt or a later one (`Floor.admits`; commits that do not record their attempt,
written by older trainers, are taken as before). The observer reads the newest
resumable commit (`CheckpointStore.newest_resumable`) and names the newest one it
skipped; `explain` says which step a launch resumes from and why, for
`status.recovery.resumeReason` and the restart's Event.

Pure: no clock, no store.
"""

from __future__ import annotations

from dataclasses import dataclass

from topotrain.api.status import TrainingJobStatus
from topotrain.checkpoints import CommittedCheckpoint
from topotrain.core.reconcile_status import CheckpointView


@dataclass(frozen=True)
class Floor:
    """The last planned change: attempt `attempt` restored `step` (None: started fresh)."""

    reason: str
    attempt: int
    step: int | None

    def admits(self, commit: CommittedCheckpoint) -> bool:
        """Whether a restart may resume from `commit`."""
        if self.step is not None and commit.step <= self.step:
            return True  # history the changed gang shares
        saved_by = commit.attempt
        return saved_by is None or saved_by >= self.attempt


def floor(status: TrainingJobStatus) -> Floor | None:
    """The floor the last planned change set (status.plannedRestore); None before any."""
    rec = status.planned_restore
    return None if rec is None else Floor(rec.reason, rec.attempt, rec.step)


def explain(status: TrainingJobStatus, view: CheckpointView | None, step: int | None,
            planned: str | None = None) -> str:
    """Why a launch resumes from `step` (`planned`: the change that launches it, if one)."""
    if view is None:
        return "the job keeps no checkpoints"
    req = status.checkpoint_request
    if planned is not None and req is not None and req.reason == planned:
        if req.state == "Committed" and req.step == step:
            return f"the checkpoint the {planned} asked for"
        if step is None:
            return f"no committed checkpoint (the {planned}'s checkpoint request {req.state})"
        return f"the newest commit (the {planned}'s checkpoint request {req.state})"
    last = floor(status)
    if step is None:
        why = "no committed checkpoint"
    elif last is None:
        why = "the newest commit"
    elif last.reason == "rollout":
        why = "the newest commit of the current spec"
    else:
        why = f"the newest commit since the {last.reason}"
    return why + _skipped(view, last)


def _skipped(view: CheckpointView, last: Floor | None) -> str:
    if view.skipped_step is None or last is None:
        return ""
    restored = "started fresh" if last.step is None else f"restored step {last.step}"
    by = "" if view.skipped_attempt is None else f" by attempt {view.skipped_attempt}"
    return (f"; step {view.skipped_step}, committed{by} after the {last.reason} to attempt "
            f"{last.attempt} {restored}, is the replaced gang's work: not resumed from")
