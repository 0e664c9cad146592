"""The operator's status write (kube.status_patch): a JSON patch that names the object it is for.

A merge patch of the status subresource ignores a metadata.uid that differs from the stored
object's, so a loop still finishing a pass for a deleted job would write onto a job re-created
under the same name. The patch tests the uid first; the real API server's answer is checked in
tests/integration/test_operator_ownership.py.
"""

from __future__ import annotations

import pytest
from topotrain.controller.status_patch import status_patch

UID = "7c1d8c2e-0000-4000-8000-000000000001"


@pytest.mark.parametrize(
    ("old", "new", "ops"),
    [
        ({}, {"phase": "Pending"}, [{"op": "add", "path": "/status", "value": {"phase": "Pending"}}]),
        ({"phase": "Pending", "attempt": 0}, {"phase": "Running", "attempt": 0},
         [{"op": "add", "path": "/status/phase", "value": "Running"}]),
        # A removed field is set to null, which the API server prunes (no status field is nullable).
        ({"phase": "Running", "reason": "PodsRunning"}, {"phase": "Running"},
         [{"op": "add", "path": "/status/reason", "value": None}]),
        # A changed nested field is set whole, never merged into what the server holds.
        ({"recovery": {"cause": "crash", "seconds": 3}}, {"recovery": {"cause": "crash", "seconds": 4}},
         [{"op": "add", "path": "/status/recovery", "value": {"cause": "crash", "seconds": 4}}]),
        ({"phase": "Running"}, {"phase": "Running"}, []),
    ],
    ids=["first-write", "changed-field", "removed-field", "nested", "unchanged"],
)
def test_each_changed_top_level_field_is_set_whole_after_the_uid_test(
    old: dict[str, object], new: dict[str, object], ops: list[dict[str, object]]
) -> None:
    phase = [{"op": "test", "path": "/status/phase", "value": old["phase"]}] if "phase" in old else []
    assert status_patch(old, new, UID) == [{"op": "test", "path": "/metadata/uid", "value": UID}, *phase, *ops]
    assert status_patch(old, new, None) == [*phase, *ops]  # no uid known: no uid test


def test_the_write_tests_the_phase_it_started_from() -> None:
    """A writer whose view of the job is stale (another replica acting meanwhile) is refused
    instead of moving a Succeeded job back to Recovering."""
    ops = status_patch({"phase": "Running", "attempt": 5}, {"phase": "Recovering", "attempt": 6}, UID)
    assert ops[:2] == [{"op": "test", "path": "/metadata/uid", "value": UID},
                       {"op": "test", "path": "/status/phase", "value": "Running"}]
    assert {"op": "add", "path": "/status/phase", "value": "Recovering"} in ops


def test_field_names_are_escaped_as_json_pointers() -> None:
    (_, op) = status_patch({"a": 1}, {"a": 1, "x/y~z": 2}, UID)  # no phase: no phase test
    assert op["path"] == "/status/x~1y~0z"
