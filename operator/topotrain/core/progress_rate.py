"""status.progress's rate, percent complete and ETA, from the trainer's heartbeat; pure.

The rate is steps per second on the operator's clock (when a pass first saw each step, never
the trainer's clock) between the window's anchor, a heartbeat of the same attempt seen up to
about WINDOW_SECONDS earlier, and the newest one. The anchor moves to the previous heartbeat
once it is older than the window, so the rate follows the last few minutes; it starts afresh
with each attempt (a restart resumes from an older step, and the new gang warms up). Percent
complete and the ETA need the run's length: `spec.training.steps` (the bundled trainer's total;
a trainer of its own may declare it there too).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from topotrain.api.status import ProgressStatus
from topotrain.core.status_edits import iso, parse

WINDOW_SECONDS = 300.0


def total_steps(training: dict[str, Any]) -> int | None:
    """The run's length from spec.training.steps; None when absent or not a positive integer."""
    steps = training.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        return None
    return steps


def duration(seconds: float) -> str:
    """A short duration for the ETA column: 45s, 12m, 3h05m, 2d04h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def advance(old: ProgressStatus | None, new: ProgressStatus, total: int | None,
            now: datetime) -> ProgressStatus:
    """`new` (a heartbeat first seen `now`) with the window, the rate, percent and ETA filled in
    from `old`, the progress last written."""
    fresh = (old is None or old.attempt != new.attempt or old.window_step is None
             or old.window_time is None or new.step < old.window_step)
    out = new.model_copy()
    if total is not None:
        out.total_steps = total
        out.percent_complete = round(min(100.0, 100.0 * new.step / total), 1)
    if fresh or old is None:
        out.window_step, out.window_time = new.step, iso(now)
        return out
    assert old.window_step is not None and old.window_time is not None
    anchor_step, anchor_time = old.window_step, parse(old.window_time)
    span = (now - anchor_time).total_seconds()
    out.window_step, out.window_time = anchor_step, old.window_time
    if span > WINDOW_SECONDS and old.observed_time and old.step >= anchor_step:
        out.window_step, out.window_time = old.step, old.observed_time  # the window slides on
    if span <= 0 or new.step <= anchor_step:
        out.steps_per_second = old.steps_per_second
    else:
        out.steps_per_second = round((new.step - anchor_step) / span, 4)
    rate = out.steps_per_second
    if total is not None and rate:
        left = max(0.0, (total - new.step) / rate)
        out.eta = duration(left)
        out.estimated_completion_time = iso(now + timedelta(seconds=left))
    return out
