"""The contract's parts that the SDK and the operator share: the contract version each side
speaks, and the hold's release (a test aid)."""

from __future__ import annotations

import signal

import pytest

from topotrain_sdk.contract import hold_release_of, hold_released


def test_a_hold_release_naming_an_attempt_releases_that_attempt_alone() -> None:
    assert hold_released("released", 0) and hold_released("yes", 7), "any other value: every attempt"
    assert not hold_released("", 0)
    assert hold_released(hold_release_of(1), 1)
    assert not hold_released(hold_release_of(1), 2), "the next attempt of the same pods holds again"
    assert not hold_released(hold_release_of(1), 0)


def test_the_sdk_reads_the_operators_contract_version_and_logs_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from topotrain_sdk.contract import CONTRACT_VERSION, CONTRACT_VERSION_ENV, TrainerEnv
    from topotrain_sdk.job import job
    from topotrain_sdk.session import Session

    monkeypatch.setattr(signal, "signal", lambda *_: None)  # the Session's SIGTERM handler: not here
    pod = {"TOPOTRAIN_JOB_NAME": "llm", "NNODES": "1", "NPROC_PER_NODE": "1", "TOPOTRAIN_DP": "1"}
    assert TrainerEnv.from_env(pod).to_env()[CONTRACT_VERSION_ENV] == "0", "an operator older than versions"
    assert job({**pod, CONTRACT_VERSION_ENV: str(CONTRACT_VERSION)}).contract_version == CONTRACT_VERSION
    assert job({}).contract_version == CONTRACT_VERSION, "outside a TrainingJob: no operator to differ"
    for theirs, older in ((0, "the operator is older"), (CONTRACT_VERSION + 1, "this SDK is older")):
        events: list[dict[str, object]] = []
        Session(job({**pod, CONTRACT_VERSION_ENV: str(theirs)}), emit=events.append)
        assert [e["event"] for e in events] == ["contract_mismatch"]
        assert events[0]["operator"] == theirs and older in str(events[0]["message"])
    events = []
    Session(job({**pod, CONTRACT_VERSION_ENV: str(CONTRACT_VERSION)}), emit=events.append)
    assert events == []
