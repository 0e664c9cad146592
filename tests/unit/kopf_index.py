"""A stand-in for a kopf index in the unit tests (a fake at the unit-test boundary)."""

from __future__ import annotations

from typing import Any


def as_index(entries: list[dict[Any, Any]]) -> dict[Any, list[Any]]:
    """Key -> values, as kopf files what the operator's index handlers return."""
    index: dict[Any, list[Any]] = {}
    for filed in entries:
        for key, value in filed.items():
            index.setdefault(key, []).append(value)
    return index
