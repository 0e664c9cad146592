"""TrainingJob status models, condition types and reasons.

Condition types and reasons are named constants (as JobSet and Kueue do);
`set_condition` moves `lastTransitionTime` only when the status flips.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from topotrain.api.conditions import ConditionType as ConditionType  # re-exported
from topotrain.api.conditions import Reason as Reason  # re-exported
from topotrain.api.progress import ProgressStatus as ProgressStatus  # re-exported
from topotrain.api.progress import TrainerStatus as TrainerStatus  # re-exported

Phase = Literal["Pending", "Starting", "Running", "Recovering", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[Phase, ...] = ("Pending", "Starting", "Running", "Recovering", "Suspended", "Succeeded", "Failed")


def now_iso() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class Condition(_Model):
    """A condition of the job: type/status/reason/message/lastTransitionTime."""

    type: str = Field(..., description="Condition type, e.g. Schedulable, Ready, Progressing, Recovering.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field("", description="CamelCase reason code.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        None, alias="lastTransitionTime", description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        None, alias="observedGeneration", description="metadata.generation the condition was computed from."
    )


class CurrentParallelism(_Model):
    """Parallelism of the running attempt (data may be below spec while shrunk)."""

    tensor: int = Field(..., description="Current tensor-parallel degree.")
    pipeline: int = Field(..., description="Current pipeline-parallel degree.")
    data: int = Field(..., description="Current data-parallel degree (scale subresource status replicas).")


class PlacementSummary(_Model):
    """Where the current attempt runs."""

    nodes: int = Field(0, description="Distinct nodes used.")
    racks: int = Field(0, description="Distinct racks used.")
    blocks: int = Field(0, description="Distinct blocks used.")
    cost: float = Field(0, description="Communication cost (NVLink domain 1, rack 4, block 16).")
    mode: str = Field("", description="initial, incremental or full: how the placement was planned.")
    message: str = Field("", description="One-line summary.")


class FailureRecord(_Model):
    """The last failure the operator acted on."""

    reason: str = Field(..., description="Reason code (PodFailed, NodeLost, ProgressStalled, ...).")
    message: str = Field("", description="Detail.")
    time: str = Field(..., description="When it was detected.")
    pod: str | None = Field(None, description="Pod involved, if any.")
    node: str | None = Field(None, description="Node involved, if any.")
    exit_code: int | None = Field(None, alias="exitCode", description="Container exit code, if any.")


class CheckpointStatus(_Model):
    """The latest committed checkpoint found in S3."""

    step: int = Field(..., description="Training step of the checkpoint.")
    uri: str = Field(..., description="s3:// URI of its directory.")
    time: str | None = Field(None, description="When it was committed.")


class RestartBudgets(_Model):
    """Restarts made so far, per failure class (each has its own budget in spec.failurePolicy)."""

    application: int = Field(0, description="Restarts after application failures (exit codes, hangs).")
    infrastructure: int = Field(
        0, description="Restarts after infrastructure failures (node lost, eviction, preemption, "
        "pod deleted, pods that never start).",
    )
    uncounted: int = Field(
        0, description="Restarts a RestartWithoutCounting failure rule made (no budget used).",
    )


class NodeFailures(_Model):
    """Failures of this job's pods attributed to one node."""

    node: str = Field(..., description="Node name.")
    failures: int = Field(0, description="Failures attributed to the node.")
    last_reason: str = Field("", alias="lastReason", description="Reason of the last one.")
    last_time: str | None = Field(None, alias="lastTime", description="When the last one happened.")
    avoided: bool = Field(False, description="True: this job's re-plans no longer use the node.")


class ResumedFromStatus(_Model):
    """The run whose checkpoints this job started from (resumePolicy Always, or MultiKueue's re-dispatch)."""

    uid: str = Field("", description="metadata.uid of the TrainingJob that wrote them; empty: unknown.")
    step: int = Field(..., description="Its highest committed step when this job took them over.")
    time: str | None = Field(None, description="When this job took them over.")
    same_run: bool | None = Field(None, alias="sameRun", description="true: its own run's, written where "
                                  "MultiKueue ran it before (uid: the manager cluster's TrainingJob).")


class CheckpointRequestStatus(_Model):
    """A checkpoint the operator asked the running gang for before a planned change (a resize).

    The value is set as the pods' topotrain.io/checkpoint-request annotation; the trainer saves
    at its next step boundary and names the value in that step's COMMITTED marker.
    """

    value: str = Field(..., description="The annotation value asked for (unique per request).")
    reason: str = Field("resize", description="The planned change it is for.")
    attempt: int = Field(..., description="The attempt whose pods were asked.")
    time: str = Field(..., description="When it was asked (the operator's clock).")
    state: Literal["Pending", "Committed", "TimedOut", "Cancelled"] = Field(
        "Pending", description="Pending (the gang keeps training while it saves), Committed (the "
        "change resumed from step), TimedOut (not committed within the bound: the change resumed "
        "from the last commit, step) or Cancelled (the change was no longer wanted, or a failure "
        "came first).",
    )
    step: int | None = Field(
        None, description="The step the change resumed from: the requested checkpoint's "
        "(Committed) or the last commit's (TimedOut).",
    )


class PlannedRestoreStatus(_Model):
    """The last planned change (a rollout, a resize, a drain) and the step its gang restored.

    The gang it replaced may still have committed later steps (trained under the old spec or
    degree) before it stopped; a later restart never resumes from those.
    """

    reason: str = Field(..., description="rollout, resize or drain.")
    attempt: int = Field(..., description="The first attempt of the changed gang.")
    step: int | None = Field(None, description="The step it restored (absent: it started fresh).")


class RecoveryPhases(_Model):
    """Where the time to first step of the last recovery went, in seconds."""

    pods_running: float | None = Field(
        None, alias="podsRunning", description="Failure detected -> every replacement pod Running "
        "(re-plan, pod creation, scheduling, container start).",
    )
    process_start: float | None = Field(
        None, alias="processStart", description="Pods Running -> the trainer process started.",
    )
    checkpoint_load: float | None = Field(
        None, alias="checkpointLoad", description="Restoring the checkpoint.",
    )
    startup_and_first_step: float | None = Field(
        None, alias="startupAndFirstStep",
        description="The rest: imports, rendezvous, building the model, the first step.",
    )


class RecoveryStatus(_Model):
    """The last recovery."""

    last_seconds: float | None = Field(
        None, alias="lastSeconds", description="Failure detected -> all replacement pods Running, seconds."
    )
    time_to_first_step_seconds: float | None = Field(
        None, alias="timeToFirstStepSeconds",
        description="Failure detected -> the new attempt's first completed training step, seconds: "
        "the recovery measure (what the RECOVERY column shows).",
    )
    phases: RecoveryPhases | None = Field(None, description="The time to first step, by phase.")
    fault_time: str | None = Field(
        None, alias="faultTime", description="When the failure (or planned change) was detected.",
    )
    cause: str | None = Field(
        None, description="application, infrastructure, resize, rollout or drain (a node of the gang "
        "was cordoned): what started the recovery.",
    )
    awaiting_attempt: int | None = Field(
        None, alias="awaitingAttempt",
        description="The attempt whose first step is awaited (pods Running, no step yet).",
    )
    pods_running_time: str | None = Field(
        None, alias="podsRunningTime", description="When the attempt's pods were all Running.",
    )
    mode: str | None = Field(
        None, description="incremental, full, shrink, grow, rollout, resize, drain, or inPlace (the healthy "
        "pods were kept and their trainer processes restarted; only replacedIndices got new pods).",
    )
    replaced_indices: list[int] | None = Field(
        None, alias="replacedIndices",
        description="An in-place restart: the pod indices that got new pods (the others were kept).",
    )
    resume_step: int | None = Field(None, alias="resumeStep", description="Checkpoint step it resumed from.")
    resume_reason: str | None = Field(
        None, alias="resumeReason",
        description="Why it resumed from resumeStep: the checkpoint a planned change asked for, or "
        "the newest commit of the current spec (naming any newer commit it skipped, and why).",
    )
    started: str | None = Field(None, description="When the failure was detected (in flight while set).")


class JobTemplateStatus(_Model):
    """The TrainingJobTemplate the job's spec was resolved from (spec.templateRef)."""

    name: str = Field(..., description="The template's name.")
    generation: int = Field(..., description="Its metadata.generation the job runs on.")
    spec: dict[str, Any] = Field(
        default_factory=dict, description="Its spec at that generation, which the job's spec is "
        "merged over: later edits of the template reach the job only with followUpdates.",
    )


class TrainingJobStatus(_Model):
    """Observed state, written by the operator once per reconcile pass."""

    phase: Phase = Field("Pending", description="Pending, Starting, Running, Recovering, Suspended, Succeeded or Failed.")
    conditions: list[Condition] = Field(default_factory=list, description="Current conditions.")
    observed_generation: int | None = Field(
        None, alias="observedGeneration", description="metadata.generation last reconciled."
    )
    parallelism: CurrentParallelism | None = Field(None, description="Parallelism of the current attempt.")
    pool: str | None = Field(None, description="GPU pool (nvidia.com/gpu.product) of the current attempt.")
    placement: PlacementSummary | None = Field(None, description="Placement of the current attempt.")
    attempt: int = Field(0, description="Restart epoch (TOPOTRAIN_ATTEMPT) of the current pods.")
    restarts: int = Field(0, description="Gang restarts so far (all classes).")
    restarts_by_class: RestartBudgets | None = Field(
        None, alias="restartsByClass", description="Restarts per failure class.",
    )
    node_failures: list[NodeFailures] = Field(
        default_factory=list, alias="nodeFailures",
        description="Nodes that failed this job's pods, and whether they are avoided.",
    )
    reason: str | None = Field(None, description="Why the job is in its phase, in one word (CamelCase).")
    message: str | None = Field(None, description="Why the job is in its phase, in words.")
    attempt_start_time: str | None = Field(
        None, alias="attemptStartTime", description="When the current attempt's pods were created.",
    )
    template_generation: int | None = Field(
        None, alias="templateGeneration",
        description="metadata.generation whose pod template the current attempt's pods run.",
    )
    last_failure: FailureRecord | None = Field(None, alias="lastFailure", description="The last failure acted on.")
    checkpoint: CheckpointStatus | None = Field(None, description="Latest committed checkpoint.")
    progress: ProgressStatus | None = Field(None, description="Latest trainer heartbeat.")
    trainer: TrainerStatus | None = Field(None, description="The cooperation seen from the trainer.")
    recovery: RecoveryStatus | None = Field(None, description="The last recovery.")
    checkpoint_request: CheckpointRequestStatus | None = Field(
        None, alias="checkpointRequest",
        description="The last checkpoint asked of the gang before a planned change.",
    )
    planned_restore: PlannedRestoreStatus | None = Field(
        None, alias="plannedRestore",
        description="The last planned change's restore step: commits after it made by earlier "
        "attempts are never resumed from.",
    )
    resumed_from: ResumedFromStatus | None = Field(
        None, alias="resumedFrom",
        description="Set when the job started from checkpoints another TrainingJob wrote, or its "
        "own run wrote on another cluster before MultiKueue dispatched it here (sameRun).",
    )
    job_template: JobTemplateStatus | None = Field(
        None, alias="jobTemplate", description="The TrainingJobTemplate the spec was resolved from.",
    )
    selector: str | None = Field(None, description="Label selector of the job's pods (scale subresource).")
    start_time: str | None = Field(None, alias="startTime", description="When the first attempt started.")
    completion_time: str | None = Field(None, alias="completionTime", description="When the job finished.")

    def to_wire(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


def set_condition(
    conditions: list[Condition], type_: str, status: bool | str, reason: str, message: str = "",
    *, generation: int | None = None, now: str | None = None,
) -> list[Condition]:
    """Return conditions with `type_` set; lastTransitionTime moves only on a flip."""
    value = status if isinstance(status, str) else ("True" if status else "False")
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type != type_:
            out.append(cond)
            continue
        found = True
        flipped = cond.status != value
        out.append(
            Condition(
                type=type_, status=value, reason=reason, message=message,  # type: ignore[arg-type]
                last_transition_time=(now or now_iso()) if flipped else cond.last_transition_time,
                observed_generation=generation,
            )
        )
    if not found:
        out.append(
            Condition(
                type=type_, status=value, reason=reason, message=message,  # type: ignore[arg-type]
                last_transition_time=now or now_iso(), observed_generation=generation,
            )
        )
    return out
