"""The contract's parts that the SDK and the operator share: the hold's release (a test aid)."""

from __future__ import annotations

from topotrain_sdk.contract import hold_release_of, hold_released


def test_a_hold_release_naming_an_attempt_releases_that_attempt_alone() -> None:
    assert hold_released("released", 0) and hold_released("yes", 7), "any other value: every attempt"
    assert not hold_released("", 0)
    assert hold_released(hold_release_of(1), 1)
    assert not hold_released(hold_release_of(1), 2), "the next attempt of the same pods holds again"
    assert not hold_released(hold_release_of(1), 0)

