"""status.progress: the trainer's last heartbeat, and the rate, percent complete and ETA the
operator derives from it (core/progress_rate.py)."""

from __future__ import annotations

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
