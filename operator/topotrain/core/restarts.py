"""The restart decision: restart the gang after a backoff, or fail the job, by the budget of the
failure's class (policy.py classifies failures; failure_rules.py may decide first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from topotrain.api.spec import FailurePolicy
from topotrain.api.status import Reason, RestartBudgets
from topotrain.core.policy import INFRASTRUCTURE, Failure


def backoff_seconds(policy: FailurePolicy, restart: int) -> float:
    """Delay before restart number `restart` (1-based): exponential, capped."""
    if restart < 1:
        return 0.0
    delay = policy.backoff_seconds * 2 ** min(restart - 1, 30)
    return float(min(delay, policy.max_backoff_seconds))


@dataclass(frozen=True)
class RestartDecision:
    """What to do about a failure: restart the gang after a delay, or fail the job."""

    action: Literal["restart", "fail"]
    reason: str
    message: str
    delay_seconds: float = 0.0
    restarts: int = 0  # the job's restart count after this decision
    counted: bool = True  # False: a RestartWithoutCounting rule's restart (no budget is used)


def used_budgets(restarts: int, by_class: RestartBudgets | None) -> RestartBudgets:
    """Restarts per class; a status from before classes were kept counts all as application."""
    return by_class.model_copy() if by_class is not None else RestartBudgets(application=restarts)


def decide(failure: Failure, used: RestartBudgets, policy: FailurePolicy) -> RestartDecision:
    """Restart or fail, given the restarts of each class made so far."""
    total = used.application + used.infrastructure
    if not failure.retryable:
        return RestartDecision("fail", Reason.NON_RETRYABLE, failure.message, restarts=total)
    infra = failure.kind == INFRASTRUCTURE
    spent = used.infrastructure if infra else used.application
    budget = policy.max_infrastructure_restarts if infra else policy.max_restarts
    if spent >= budget:
        field_name = "maxInfrastructureRestarts" if infra else "maxRestarts"
        return RestartDecision(
            "fail", Reason.MAX_INFRA_RESTARTS if infra else Reason.MAX_RESTARTS,
            f"{failure.message}; spec.failurePolicy.{field_name} ({budget}) exhausted by "
            f"{spent} {failure.kind} failure(s)",
            restarts=total,
        )
    nth = spent + 1
    delay = backoff_seconds(policy, nth)
    return RestartDecision(
        "restart", failure.reason,
        f"{failure.message}; {failure.kind} restart {nth}/{budget} after {delay:g}s",
        delay_seconds=delay, restarts=total + 1,
    )
