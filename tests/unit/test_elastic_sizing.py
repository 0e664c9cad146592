"""Elastic sizing decisions."""

from __future__ import annotations

import pytest
from topotrain.api import Parallelism
from topotrain.elastic import resize_kind, resize_request, valid_degrees
from topotrain.status import Reason


@pytest.mark.parametrize(
    ("tp", "pp", "gpp", "low", "high", "degrees"),
    [(2, 2, 2, 1, 4, [4, 3, 2, 1]), (2, 1, 8, 1, 16, [16, 12, 8, 4]), (8, 4, 8, 2, 4, [4, 3, 2])],
)
def test_valid_degrees_fill_whole_pods(tp: int, pp: int, gpp: int, low: int, high: int,
                                       degrees: list[int]) -> None:
    par = Parallelism(tensor=tp, pipeline=pp, data=high)
    assert valid_degrees(par, gpp, low, high) == degrees


@pytest.mark.parametrize(
    ("data", "min_data", "current", "expected"),
    [
        (4, 2, 4, None),  # at target
        (4, 2, 2, (3, 4, Reason.GREW)),  # shrunk earlier: try to grow
        (2, 1, 4, (1, 2, Reason.SHRUNK)),  # kubectl scale down
        (4, None, 2, (3, 4, Reason.GREW)),  # kubectl scale up
    ],
)
def test_resize_request(data: int, min_data: int | None, current: int,
                        expected: tuple[int, int, str] | None) -> None:
    request = resize_request(Parallelism(data=data, minData=min_data), current)
    got = None if request is None else (request.low, request.high, request.reason)
    assert got == expected


@pytest.mark.parametrize(("current", "feasible", "worth"), [(2, 2, False), (2, 3, True), (2, 4, True)])
def test_grow_only_when_larger(current: int, feasible: int, worth: bool) -> None:
    request = resize_request(Parallelism(data=4, minData=1), current)
    assert request is not None and request.worth_it(feasible) is worth


@pytest.mark.parametrize(("before", "after", "kind"), [(4, 2, "shrink"), (2, 4, "grow"), (3, 3, "")])
def test_resize_kind(before: int, after: int, kind: str) -> None:
    assert resize_kind(before, after) == kind
