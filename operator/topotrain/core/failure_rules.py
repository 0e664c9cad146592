"""The user's failure rules (`spec.failurePolicy.rules`, api/failure_rules.py) over the
built-in policy (policy.py): which failure a rule matches, and the verdict it gives.

Pure: a rule is read against `policy.Failure`, whose pod facts (container exits, conditions,
termination reason and message) the detection copied from the failed pod. The failure the
operator acts on comes first, then the others seen in the same pass (`Failure.others`); the
first rule, in the spec's order, that matches any of them decides, and the failure it matched
becomes the one recorded. No rule matches: `restarts.decide`, today's behaviour, which
docs/api.md writes out as the default rule set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from topotrain.api.failure_rules import ExitCodeMatch, FailureRule
from topotrain.api.spec import FailurePolicy
from topotrain.api.status import Reason, RestartBudgets
from topotrain.core.manifests import CONTAINER
from topotrain.core.policy import Failure
from topotrain.core.restarts import RestartDecision, decide

FAILED_BY_RULE = Reason.FAILED_BY_RULE


@dataclass(frozen=True)
class RuleMatch:
    """The rule that decides a failure: its index in spec.failurePolicy.rules, and the failure
    (the acted-on one or one seen with it) it matched."""

    index: int
    rule: FailureRule
    failure: Failure

    @property
    def words(self) -> str:
        return f"spec.failurePolicy.rules[{self.index}] {self.rule.name!r} ({self.rule.action})"


def _exit_codes(match: ExitCodeMatch, failure: Failure) -> bool:
    # A failure without the pod's exits is a supervisor's report of its trainer's exit code.
    exits = failure.exits or (((CONTAINER, failure.exit_code),) if failure.exit_code else ())
    for container, code in exits:
        if match.container_name is not None and container != match.container_name:
            continue
        if (code in match.values) == (match.operator == "In") and code != 0:
            return True
    return False


def matches(rule: FailureRule, failure: Failure) -> bool:
    """True when every match field `rule` sets matches `failure` (none set: every failure)."""
    if rule.on_exit_codes is not None and not _exit_codes(rule.on_exit_codes, failure):
        return False
    if rule.on_pod_conditions is not None and not any(
            (c.type, c.status) in failure.conditions for c in rule.on_pod_conditions):
        return False
    if rule.on_termination_reasons is not None and (
            failure.termination_reason not in rule.on_termination_reasons):
        return False
    if rule.on_failure_reasons is not None and failure.reason not in rule.on_failure_reasons:
        return False
    if rule.message_pattern is not None:
        pattern = re.compile(rule.message_pattern)
        if not (pattern.search(failure.detail) or pattern.search(failure.message)):
            return False
    return True


def first_match(rules: list[FailureRule], failure: Failure) -> RuleMatch | None:
    """The first rule, in order, that matches `failure` or one of the failures seen with it."""
    candidates = (failure, *failure.others)
    for index, rule in enumerate(rules):
        for candidate in candidates:
            if matches(rule, candidate):
                return RuleMatch(index, rule, candidate)
    return None


def acted_on(failure: Failure, match: RuleMatch | None) -> Failure:
    """The failure the job records: the one the rule matched, with the pass's lost and blamed
    nodes (they are the whole pass's, whichever failure is named)."""
    if match is None or match.failure is failure:
        return failure
    return replace(match.failure, lost_nodes=failure.lost_nodes | match.failure.lost_nodes,
                   blamed=failure.blamed | match.failure.blamed, others=())


def verdict(failure: Failure, match: RuleMatch | None, used: RestartBudgets,
            policy: FailurePolicy) -> RestartDecision:
    """Restart or fail: the matched rule's action, else the built-in policy's."""
    if match is None:
        return decide(failure, used, policy)
    total = used.application + used.infrastructure
    action = match.rule.action
    if action == "Fail":
        return RestartDecision("fail", FAILED_BY_RULE, f"{failure.message}; {match.words} matched",
                               restarts=total)
    if action == "Restart":
        counted = decide(replace(failure, retryable=True), used, policy)
        return replace(counted, message=f"{counted.message}; {match.words} matched")
    delay = float(min(policy.backoff_seconds, policy.max_backoff_seconds))
    return RestartDecision(
        "restart", failure.reason,
        f"{failure.message}; {match.words} matched: restart after {delay:g}s, no budget used",
        delay_seconds=delay, restarts=total, counted=False,
    )


def decide_with_rules(failure: Failure, used: RestartBudgets,
                      policy: FailurePolicy) -> tuple[Failure, RestartDecision]:
    """The failure the job acts on (a rule may pick one seen with it) and the verdict."""
    match = first_match(policy.rules, failure)
    chosen = acted_on(failure, match)
    return chosen, verdict(chosen, match, used, policy)
