"""spec.failurePolicy.rules (issue 36): each match field and each action, as tables; then the
reconciler acting on a rule's verdict, pass by pass, no cluster."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError
from test_reconcile import T0, gang, run, running_job, spec
from topotrain.api.failure_rules import FailureRule
from topotrain.api.spec import FailurePolicy
from topotrain.api.status import Reason, RestartBudgets
from topotrain.core.failure_rules import decide_with_rules, first_match, matches
from topotrain.core.policy import Failure, NodeView, PodView, detect_failure

CRASH = Failure(Reason.POD_FAILED, "pod job-1 failed with exit code 3", pod="job-1", exit_code=3,
                exits=(("trainer", 3),), termination_reason="Error",
                detail="RuntimeError: CUDA error: an illegal memory access was encountered")
OOM = Failure(Reason.POD_FAILED, "pod job-2 failed with exit code 137 (OOMKilled)", pod="job-2",
              exit_code=137, exits=(("trainer", 137),), termination_reason="OOMKilled")
DISRUPTED = Failure(Reason.POD_DELETED, "pod job-0 is being deleted", pod="job-0",
                    conditions=frozenset({("DisruptionTarget", "True")}))
LOST = Failure(Reason.NODE_LOST, "node n3 of pod job-3 was deleted", pod="job-3", node="n3")
REPORTED = Failure(Reason.POD_FAILED, "pod job-1's trainer exited with code 3", exit_code=3)


def rule(**fields: Any) -> FailureRule:
    return FailureRule.model_validate({"name": "r", "action": "Fail", **fields})


@pytest.mark.parametrize(("fields", "failure", "hit"), [
    ({}, LOST, True),  # no match field: every failure
    ({"onExitCodes": {"values": [3]}}, CRASH, True),
    ({"onExitCodes": {"values": [4, 5]}}, CRASH, False),
    ({"onExitCodes": {"operator": "NotIn", "values": [137]}}, CRASH, True),
    ({"onExitCodes": {"operator": "NotIn", "values": [137]}}, OOM, False),
    ({"onExitCodes": {"operator": "NotIn", "values": [1]}}, LOST, False),  # no exit code at all
    ({"onExitCodes": {"containerName": "trainer", "values": [3]}}, CRASH, True),
    ({"onExitCodes": {"containerName": "sidecar", "values": [3]}}, CRASH, False),
    ({"onExitCodes": {"containerName": "trainer", "values": [3]}}, REPORTED, True),  # a supervisor's report
    ({"onPodConditions": [{"type": "DisruptionTarget"}]}, DISRUPTED, True),
    ({"onPodConditions": [{"type": "DisruptionTarget", "status": "False"}]}, DISRUPTED, False),
    ({"onPodConditions": [{"type": "DisruptionTarget"}]}, CRASH, False),
    ({"onTerminationReasons": ["OOMKilled"]}, OOM, True),
    ({"onTerminationReasons": ["OOMKilled"]}, CRASH, False),
    ({"onFailureReasons": ["NodeLost", "NodeNotReady"]}, LOST, True),
    ({"onFailureReasons": ["ProgressStalled"]}, LOST, False),
    ({"messagePattern": "CUDA error: an illegal"}, CRASH, True),  # the pod's termination message
    ({"messagePattern": "node n[0-9] of pod"}, LOST, True),  # the operator's description
    ({"messagePattern": "^NCCL"}, CRASH, False),
    ({"onExitCodes": {"values": [3]}, "onTerminationReasons": ["OOMKilled"]}, CRASH, False),  # all must match
    ({"onExitCodes": {"values": [3]}, "messagePattern": "CUDA"}, CRASH, True),
])
def test_a_rule_matches_when_every_field_it_sets_matches(
        fields: dict[str, Any], failure: Failure, hit: bool) -> None:
    assert matches(rule(**fields), failure) is hit


NONE_USED = RestartBudgets()


@pytest.mark.parametrize(("action", "failure", "used", "want"), [
    # (action, decision, reason, restarts after, budgets charged)
    ("Fail", CRASH, NONE_USED, ("fail", Reason.FAILED_BY_RULE, 0, True)),
    ("Fail", LOST, RestartBudgets(infrastructure=2), ("fail", Reason.FAILED_BY_RULE, 2, True)),
    ("Restart", CRASH, NONE_USED, ("restart", Reason.POD_FAILED, 1, True)),
    ("Restart", replace(CRASH, reason=Reason.NON_RETRYABLE, retryable=False), NONE_USED,
     ("restart", Reason.NON_RETRYABLE, 1, True)),  # a rule may retry what the defaults fail
    ("Restart", CRASH, RestartBudgets(application=2), ("fail", Reason.MAX_RESTARTS, 2, True)),
    ("Restart", LOST, RestartBudgets(application=2), ("restart", Reason.NODE_LOST, 3, True)),
    ("RestartWithoutCounting", DISRUPTED, RestartBudgets(infrastructure=5),
     ("restart", Reason.POD_DELETED, 5, False)),  # even past the budget: nothing is counted
])
def test_each_action_gives_its_verdict(action: str, failure: Failure, used: RestartBudgets,
                                       want: tuple[str, str, int, bool]) -> None:
    policy = FailurePolicy.model_validate({
        "maxRestarts": 2, "maxInfrastructureRestarts": 5, "backoffSeconds": 7,
        "rules": [{"name": "the-rule", "action": action}],
    })
    _, verdict = decide_with_rules(failure, used, policy)
    assert (verdict.action, verdict.reason, verdict.restarts, verdict.counted) == want
    assert "spec.failurePolicy.rules[0] 'the-rule'" in verdict.message
    if action == "RestartWithoutCounting":
        assert verdict.delay_seconds == 7  # backoffSeconds, never doubled


def test_without_rules_the_built_in_policy_decides() -> None:
    policy = FailurePolicy()
    _, verdict = decide_with_rules(replace(CRASH, exit_code=78, reason=Reason.NON_RETRYABLE,
                                           retryable=False), NONE_USED, policy)
    assert (verdict.action, verdict.reason) == ("fail", Reason.NON_RETRYABLE)
    _, verdict = decide_with_rules(LOST, NONE_USED, policy)
    assert (verdict.action, verdict.reason, verdict.counted) == ("restart", Reason.NODE_LOST, True)


def test_the_first_rule_in_order_wins_even_for_a_failure_seen_alongside() -> None:
    """Rank 2 ran out of memory, which crashed rank 1's collective (exit 3, reported first): the
    OOM rule, listed first, decides, and the OOM is the failure recorded."""
    both = replace(CRASH, others=(OOM,))
    rules = [rule(name="oom", onTerminationReasons=["OOMKilled"]),
             rule(name="any-crash", action="Restart", onExitCodes={"values": [3]})]
    match = first_match(rules, both)
    assert match is not None and (match.index, match.failure.pod) == (0, "job-2")
    policy = FailurePolicy.model_validate({"rules": [r.to_wire() for r in rules]})
    chosen, verdict = decide_with_rules(both, NONE_USED, policy)
    assert chosen.pod == "job-2" and verdict.action == "fail"
    assert "rules[0] 'oom' (Fail) matched" in verdict.message


def test_detection_carries_the_pod_facts_the_rules_read() -> None:
    pods = [PodView("job-0", 0, 0, phase="Running", node="n0", terminating=True,
                    conditions=frozenset({("DisruptionTarget", "True")})),
            PodView("job-1", 1, 0, phase="Failed", node="n1", exit_code=3, reason="Error",
                    exits=(("trainer", 3),), message="CUDA error")]
    found = detect_failure(pods, 2, {"n0": NodeView("n0"), "n1": NodeView("n1")}, FailurePolicy(),
                           started=True)
    assert found is not None and found.reason == Reason.POD_FAILED
    assert (found.exits, found.termination_reason, found.detail) == ((("trainer", 3),), "Error", "CUDA error")
    assert [o.conditions for o in found.others] == [frozenset({("DisruptionTarget", "True")})]


@pytest.mark.parametrize(("rules", "field"), [
    ([{"name": "a", "action": "Fail", "messagePattern": "(unclosed"}], "rules[0]"),
    ([{"name": "a", "action": "Fail"}, {"name": "a", "action": "Restart"}], "rules"),
    ([{"name": "a", "action": "Fail", "onExitCodes": {"values": [0]}}], "rules[0].onExitCodes"),
    ([{"name": "Not_A_Label", "action": "Fail"}], "rules[0].name"),
    ([{"name": "a", "action": "Fail", "onFailureReasons": ["Unheard"]}], "rules[0].onFailureReasons"),
])
def test_an_invalid_rule_is_refused_naming_its_field(rules: list[dict[str, Any]], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        FailurePolicy.model_validate({"rules": rules})
    locs = [".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]).replace(".[", "[")
            for e in err.value.errors()]
    assert any(loc.startswith(field) for loc in locs), locs


# --- the reconciler acting on a rule ---------------------------------------------------------


def _crashed(attempt: int, **pod: Any) -> tuple[PodView, ...]:
    pods = list(gang(attempt))
    pods[1] = replace(pods[1], phase="Failed", **pod)
    return tuple(pods)


def test_a_fail_rule_ends_the_job_on_the_first_occurrence_naming_the_rule() -> None:
    obs = running_job(spec=spec(rules=[{"name": "bad-data", "action": "Fail",
                                        "onExitCodes": {"values": [3]}}]))
    d, _ = run(obs, pods=_crashed(0, exit_code=3, exits=(("trainer", 3),)), now=T0)
    assert d.status.phase == "Failed" and d.status.reason == Reason.FAILED_BY_RULE
    assert "rules[0] 'bad-data' (Fail) matched" in (d.status.message or "")
    assert d.status.restarts == 0 and d.launch is None


def test_a_disruption_restart_without_counting_leaves_the_budgets_untouched() -> None:
    obs = running_job(spec=spec(maxInfrastructureRestarts=0, rules=[
        {"name": "free", "action": "RestartWithoutCounting",
         "onPodConditions": [{"type": "DisruptionTarget"}]}]))
    d, _ = run(obs, pods=_crashed(0, exit_code=137, reason="Evicted",
                                  conditions=frozenset({("DisruptionTarget", "True")})), now=T0)
    assert d.status.phase == "Recovering" and d.status.attempt == 1, d.status.message
    used = d.status.restarts_by_class
    assert used is not None and (used.application, used.infrastructure, used.uncounted) == (0, 0, 1)
    assert d.status.restarts == 0
