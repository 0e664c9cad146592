"""`spec.failurePolicy.rules`: what the user says about a failure, before the built-in policy.

Rules are evaluated in order against the failure the operator is about to act on (and the
other failures seen with it in the same pass); the first rule that matches decides. A rule
matches when every match field it sets matches (a rule with none matches every failure):

- `onExitCodes`: a terminated container's exit code (In or NotIn `values`; `containerName`
  narrows it to one container);
- `onPodConditions`: a condition of the failed pod (`DisruptionTarget`, ...) with `status`;
- `onTerminationReasons`: the pod's status.reason or its container's terminated reason
  (`OOMKilled`, `Evicted`, `Error`, ...);
- `onFailureReasons`: the operator's own name for the failure (PodFailed, NodeLost, ...);
- `messagePattern`: a regular expression searched in the pod's termination message (its log
  tail) and in the operator's description of the failure.

Actions: `Fail` ends the job at once (reason FailedByRule, the message names the rule);
`Restart` restarts the gang against the budget of the failure's class; `RestartWithoutCounting`
restarts it after `backoffSeconds` without touching either budget. Without a matching rule
the built-in rules apply (docs/api.md, "Failure rules"). The policy itself is
`topotrain.core.failure_rules`; each CEL rule here has its Python twin.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, model_validator

from topotrain.api.pod import DNS_LABEL, MAX_LIST, WireModel, cel

MAX_RULES = 32
MAX_PATTERN = 1024
RuleAction = Literal["Fail", "Restart", "RestartWithoutCounting"]
# The operator's failure reasons a rule may name (api.status.Reason; policy.py detects them).
FailureReasonName = Literal[
    "NonRetryableExitCode", "PodFailed", "PodEvicted", "PodPreempted", "PodDeleted", "NodeLost",
    "NodeNotReady", "PodsNotStarting", "ProgressStalled",
]
EXIT_IN_ZERO_RULE = {
    "rule": "self.operator == 'NotIn' || !self.values.exists(v, v == 0)",
    "message": "operator In must not list 0: a container that exits 0 did not fail",
    "fieldPath": ".values",
}
UNIQUE_NAMES_RULE = {
    "rule": "self.all(r, self.filter(s, s.name == r.name).size() == 1)",
    "message": "rule names must be unique",
}


class ExitCodeMatch(WireModel):
    """Exit codes of the failed pod's containers."""

    model_config = WireModel.model_config | {"json_schema_extra": cel(EXIT_IN_ZERO_RULE)}
    container_name: str | None = Field(
        None, alias="containerName", max_length=63,
        description="Only this container's exit code (the trainer container is `trainer`). "
        "Default: any container of the pod.",
    )
    operator: Literal["In", "NotIn"] = Field(
        "In", description="In: the code is one of values; NotIn: a non-zero code not in values.",
    )
    values: list[Annotated[int, Field(ge=0, le=255)]] = Field(
        ..., min_length=1, max_length=MAX_LIST, description="Exit codes (0-255).",
    )

    @model_validator(mode="after")
    def _in_not_zero(self) -> ExitCodeMatch:
        if self.operator == "In" and 0 in self.values:
            raise ValueError(f"values: {EXIT_IN_ZERO_RULE['message']}")
        return self


class PodConditionMatch(WireModel):
    """A condition of the failed pod."""

    type: str = Field(
        ..., min_length=1, max_length=316,
        description="Condition type, e.g. DisruptionTarget (the pod was evicted, preempted or "
        "deleted by a disruption: its reason says which).",
    )
    status: Literal["True", "False", "Unknown"] = Field("True", description="Condition status.")


class FailureRule(WireModel):
    """One rule: which failures it matches (every set field must match) and what to do."""

    name: str = Field(
        ..., min_length=1, max_length=63, pattern=DNS_LABEL,
        description="The rule's name (a DNS label), given in the job's status and Events when "
        "it decides.",
    )
    action: RuleAction = Field(
        ..., description="Fail (the job fails at once, reason FailedByRule), Restart (counted "
        "against the budget of the failure's class) or RestartWithoutCounting (after "
        "backoffSeconds; neither budget is touched).",
    )
    on_exit_codes: ExitCodeMatch | None = Field(
        None, alias="onExitCodes", description="Match a terminated container's exit code.",
    )
    on_pod_conditions: list[PodConditionMatch] | None = Field(
        None, alias="onPodConditions", min_length=1, max_length=MAX_LIST,
        description="Match when the failed pod has any of these conditions.",
    )
    on_termination_reasons: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        None, alias="onTerminationReasons", min_length=1, max_length=MAX_LIST,
        description="Match the pod's status.reason or its container's terminated reason "
        "(OOMKilled, Evicted, Error, ...).",
    )
    on_failure_reasons: list[FailureReasonName] | None = Field(
        None, alias="onFailureReasons", min_length=1, max_length=MAX_LIST,
        description="Match the operator's reason for the failure (PodFailed, NodeLost, "
        "ProgressStalled, ...: status.lastFailure.reason).",
    )
    message_pattern: str | None = Field(
        None, alias="messagePattern", min_length=1, max_length=MAX_PATTERN,
        description="A regular expression (Python syntax, searched) matched against the pod's "
        "termination message (its log tail) and the operator's description of the failure.",
    )

    @model_validator(mode="after")
    def _pattern(self) -> FailureRule:
        if self.message_pattern is not None:
            try:
                re.compile(self.message_pattern)
            except re.error as exc:
                raise ValueError(f"messagePattern is not a regular expression: {exc}") from exc
        return self


def unique_names(rules: list[FailureRule]) -> list[FailureRule]:
    """UNIQUE_NAMES_RULE's twin."""
    seen: set[str] = set()
    for rule in rules:
        if rule.name in seen:
            raise ValueError(f"{UNIQUE_NAMES_RULE['message']} ({rule.name!r} is used twice)")
        seen.add(rule.name)
    return rules
