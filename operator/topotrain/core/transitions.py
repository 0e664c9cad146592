"""Status transitions applied in one place: what a pass changes, settled into its one status write.

The steps of a pass (reconcile.py and its branches) say what should change through the pass's
one `StatusBuilder`: the phase, the conditions, the counters and records, and the Events of
the flips. `settle` is the one function that finishes them (a checkpoint request of an attempt
that is gone is cancelled, status.reason/message are summarized) and gives the status to write
with its Events: the controller writes it once, only when it differs, and posts the Events
(JobSet's status update options, collected by its reconcile and applied once, are the model).

The controller never edits a status itself. What it learns while acting on a decision (the API
server refused the gang's pods, or created them after refusing) comes into the next pass as a
field of `Observed` and is said in status by `observe_edge`, as the first change of that pass;
a spec that does not parse is said by `reject_spec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from topotrain.api.status import ConditionType, Reason, TrainingJobStatus, set_condition
from topotrain.core import planned
from topotrain.core.decision import Decision, Observed, Refusal
from topotrain.core.reconcile_status import StatusBuilder

FINISHED = ("Succeeded", "Failed")


def refusal_condition(refused: Mapping[str, str]) -> Refusal:
    """The PodsCreated=False reason and message for the API server's refusals of the gang's pods
    (pod name -> "<HTTP code>: <the API server's message>")."""
    name, text = next(iter(sorted(refused.items())))
    code = text.split(":", 1)[0]
    if code == "409" and "not owned by this TrainingJob" in text:
        reason = Reason.FOREIGN_OBJECT  # another object's pod holds the name: wait, never fail
    elif code == "403" and "exceeded quota" in text:
        reason = Reason.QUOTA_EXCEEDED
    elif code in ("400", "422"):
        reason = Reason.POD_SPEC_INVALID
    else:
        reason = Reason.POD_CREATE_REFUSED
    more = f" (+{len(refused) - 1} more)" if len(refused) > 1 else ""
    return Refusal(reason, f"the API server refused pod {name}{more}: {text}; the gang was not started")


def observe_edge(obs: Observed, sb: StatusBuilder) -> None:
    """What the controller learned since the last status write: a checkpoint prefix taken over
    (status.resumedFrom), the template generation the spec resolved over (status.jobTemplate), and the API server's answer to the last launch's pod creates."""
    if obs.took_over is not None:
        sb.took_over(obs.took_over)
    if obs.job_template is not None:
        sb.job_template(obs.job_template)
    if sb.status.phase in FINISHED:
        return
    if obs.refusal is not None:
        sb.pods_refused(obs.refusal.reason, obs.refusal.message)
    elif obs.accepted is not None:
        sb.pods_accepted(obs.accepted.attempt, obs.accepted.count)


def settle(decision: Decision, sb: StatusBuilder) -> Decision:
    """The pass's one status write and its Events, from every change its steps made."""
    planned.settle(sb)
    sb.summarize()
    decision.status = sb.status
    decision.events = list(dict.fromkeys([*decision.events, *sb.events]))
    return decision


def reject_spec(status: TrainingJobStatus, problems: list[str], now: datetime,
                reason: str = Reason.INVALID_SPEC) -> Decision:
    """The spec does not parse, or does not resolve over its template (core/templates.py):
    ConfigValid=False (`reason`, the problems naming their fields), and nothing else is decided
    or changed until it does."""
    out = status.model_copy(deep=True)
    seconds = now.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    out.conditions = set_condition(out.conditions, ConditionType.CONFIG_VALID, False,
                                   reason, " ".join(problems), now=seconds)
    return Decision(status=out)
