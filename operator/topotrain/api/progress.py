"""status.progress: the trainer's last heartbeat, and the rate, percent complete and ETA the
operator derives from it (core/progress_rate.py); status.trainer: the cooperation seen from the
trainer (core/cooperation.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ProgressStatus(BaseModel):
    """The trainer's last heartbeat (progress.json)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    step: int = Field(..., description="Last step reported.")
    time: str | None = Field(None, description="When it was reported (the trainer's clock).")
    attempt: int | None = Field(None, description="The attempt whose trainer reported it.")
    observed_time: str | None = Field(
        None, alias="observedTime",
        description="When the operator first saw this step (the operator's clock; the hang clock "
        "starts here, so clock skew between nodes cannot fake or hide a hang).",
    )
    total_steps: int | None = Field(
        None, alias="totalSteps", description="The run's length in steps (spec.training.steps).",
    )
    percent_complete: float | None = Field(
        None, alias="percentComplete", description="step / totalSteps, in percent (the PROGRESS column).",
    )
    steps_per_second: float | None = Field(
        None, alias="stepsPerSecond",
        description="Training steps per second over about the last 5 minutes of this attempt "
        "(the operator's clock: when it first saw each step).",
    )
    eta: str | None = Field(
        None, description="Time left at that rate, as of observedTime (the ETA column): 45s, 12m, 3h05m.",
    )
    estimated_completion_time: str | None = Field(
        None, alias="estimatedCompletionTime", description="observedTime + the time left (RFC 3339).",
    )
    window_step: int | None = Field(
        None, alias="windowStep", description="The step the rate's window starts at.",
    )
    window_time: str | None = Field(
        None, alias="windowTime", description="When the operator saw windowStep.",
    )


class TrainerStatus(BaseModel):
    """The cooperation the operator has seen from the job's trainer (docs/byo-trainer.md: which
    topotrain feature needs which); the TrainerCooperation condition says what is missing."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    heartbeat: bool = Field(False, description="A heartbeat (progress.json) was seen: hang detection works.")
    commits: bool = Field(False, description="A committed checkpoint was seen: restarts resume from it.")
    checkpoint_requests: Literal["Honoured", "TimedOut"] | None = Field(
        None, alias="checkpointRequests", description="The last planned change's checkpoint request: "
        "Honoured (committed in time, nothing lost) or TimedOut (resumed from an older commit).")
    contract_version: int | None = Field(None, alias="contractVersion", description="The contract "
        "version the trainer's SDK reports in its heartbeat (none: no heartbeat yet, or an older SDK).")
