"""Elastic sizing: when the data-parallel degree should shrink or grow.

The planner picks the largest feasible data degree in a range; this module
decides which range to ask for and whether the answer is worth a restart.

- Failure with no spare capacity: re-plan in [minData, data] and take what
  fits (shrink), instead of waiting for capacity that may never come.
- Running below `spec.parallelism.data`: ask for (current, data]; a larger
  feasible degree restarts the gang from the latest checkpoint (grow).
- `kubectl scale` lowering `spec.parallelism.data` below the running degree:
  restart at the new degree (shrink).

Only allowed degrees (`topotrain.degrees`: whole pods and what the trainer
needs) are ever chosen; the planner filters by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from topotrain.api.spec import Parallelism
from topotrain.api.status import Reason
from topotrain.degrees import DataLimits, DegreeRule


def degree_fits_pods(par: Parallelism, data: int, gpus_per_pod: int) -> bool:
    """A data degree is usable only if its ranks fill whole pods."""
    return data >= 1 and (par.tensor * par.pipeline * data) % gpus_per_pod == 0


def valid_degrees(
    par: Parallelism, gpus_per_pod: int, low: int, high: int, limits: DataLimits | None = None
) -> list[int]:
    """Allowed data degrees in [low, high], largest first (`api.validation.limits_for(spec)` gives `limits`)."""
    rule = DegreeRule(par.tensor, par.pipeline, gpus_per_pod, limits or DataLimits())
    return rule.degrees(low, high)


def pods_for(par: Parallelism, data: int, gpus_per_pod: int) -> int:
    return par.tensor * par.pipeline * data // gpus_per_pod


def bounds(par: Parallelism) -> tuple[int, int]:
    """The data degrees a (re)start may use: [minData, data]."""
    return min(par.effective_min_data, par.data), par.data


@dataclass(frozen=True)
class ResizeRequest:
    """Ask the planner for a degree in [low, high]; restart if it differs from `current`."""

    low: int
    high: int
    current: int
    reason: str
    message: str

    def worth_it(self, feasible_data: int) -> bool:
        """Restart only when the planner's degree moves in the requested direction."""
        if self.reason == Reason.GREW:
            return feasible_data > self.current
        return feasible_data != self.current and self.low <= feasible_data <= self.high


def resize_request(
    par: Parallelism, current: int, rule: DegreeRule | None = None
) -> ResizeRequest | None:
    """What to ask the planner while Running at data degree `current`, or None.

    With `rule` (`api.validation.degree_rule(spec)`), None also when no allowed degree lies in the
    direction of the resize, so the planner is not asked for what can never run.
    """
    low, high = bounds(par)
    if rule is not None and current < high and not rule.degrees(current + 1, high):
        return None
    if rule is not None and current > high and not rule.degrees(low, high):
        return None
    if current > high:
        return ResizeRequest(
            low, high, current, Reason.SHRUNK,
            f"spec.parallelism.data is {high}, running at {current}: shrinking",
        )
    if current < high:
        return ResizeRequest(
            current + 1, high, current, Reason.GREW,
            f"running at data={current} below spec.parallelism.data={high}: growing",
        )
    return None


def resize_kind(previous: int, new: int) -> str:
    """How a restart changed the degree: shrink, grow, or '' (same degree)."""
    if new < previous:
        return "shrink"
    if new > previous:
        return "grow"
    return ""
