"""Elastic sizing decisions."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from test_placement_support import node
from topotrain.api.spec import Parallelism, TrainingJobSpec
from topotrain.api.status import Reason
from topotrain.api.validation import degree_rule, limits_for
from topotrain.core.elastic import bounds, resize_kind, resize_request, valid_degrees
from topotrain.core.planning import PlacementPlanner
from topotrain.degrees import REASON
from topotrain.placement.topology import Inventory

from tests.example_manifests import ROOT

# The shipped elastic job: tp=4 pp=2 data=4 minData=2, 4 GPUs a pod (2 pods a replica),
# globalBatch 64 with the bundled trainer's microBatch 2: data 3 would exit 78.
ELASTIC = yaml.safe_load((ROOT / "examples" / "elastic-two-pools.yaml").read_text())["spec"]


def elastic_spec(**parallelism: Any) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        **ELASTIC, "parallelism": {**ELASTIC["parallelism"], **parallelism},
    })


def h100(count: int) -> list[dict[str, Any]]:
    """4-GPU H100 nodes, each its own NVLink domain, in one rack."""
    return [node(f"h{i}", 4, rack="r0") for i in range(count)]


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


def test_the_elastic_example_may_run_at_4_or_2_only() -> None:
    spec = elastic_spec()
    assert valid_degrees(spec.parallelism, 4, *bounds(spec.parallelism), limits_for(spec)) == [4, 2]


def test_losing_a_node_shrinks_the_elastic_example_from_4_to_2_not_3() -> None:
    """7 nodes left hold 3 replicas, but data=3 splits globalBatch 64 unevenly: plan 2."""
    spec = elastic_spec()
    planner = PlacementPlanner(spec, Inventory.from_snapshot(h100(7), []))
    outcome = planner.plan(*bounds(spec.parallelism))
    assert outcome.feasible and outcome.data == 2 and len(outcome.assignments) == 4


def test_recovery_replan_after_a_node_loss_shrinks_to_2_not_3() -> None:
    spec = elastic_spec()
    nodes = h100(8)
    running = PlacementPlanner(spec, Inventory.from_snapshot(nodes, [])).plan(2, 4)
    assert running.data == 4
    lost = frozenset({running.assignments[0]})
    after = PlacementPlanner(spec, Inventory.from_snapshot([n for n in nodes if n["metadata"]["name"] not in lost], []))
    outcome = after.replan(running.assignments, lost, 2, 4)
    assert outcome.feasible and outcome.data == 2


def test_growing_back_skips_a_degree_the_trainer_rejects() -> None:
    spec = elastic_spec()
    rule = degree_rule(spec)
    request = resize_request(spec.parallelism, 2, rule)
    assert request is not None and (request.low, request.high) == (3, 4)
    planner = PlacementPlanner(spec, Inventory.from_snapshot(h100(7), []))
    outcome = planner.plan(request.low, request.high)  # room for 3 replicas, not 4
    assert not outcome.feasible


def test_no_resize_is_asked_for_when_no_allowed_degree_lies_that_way() -> None:
    """A spec stored before the rule at data=3, running at 2: nothing to grow to."""
    spec = elastic_spec(data=3)
    assert resize_request(spec.parallelism, 2, degree_rule(spec)) is None
    assert resize_request(spec.parallelism, 2) is not None  # without the rule, it would ask


def test_a_range_without_an_allowed_degree_is_unschedulable_naming_the_rule() -> None:
    spec = elastic_spec(data=3, minData=3)
    outcome = PlacementPlanner(spec, Inventory.from_snapshot(h100(8), [])).plan(3, 3)
    assert not outcome.feasible and outcome.reason == REASON
    assert "training.globalBatch=64 must be a multiple of microBatch*data=2*3" in outcome.message


def test_data_multiple_bounds_elastic_sizing_for_a_trainer_of_ones_own() -> None:
    spec = TrainingJobSpec.model_validate({
        **ELASTIC, "training": {"anything": "mine"},
        "parallelism": {**ELASTIC["parallelism"], "dataMultiple": 2},
    })
    planner = PlacementPlanner(spec, Inventory.from_snapshot(h100(7), []))
    outcome = planner.plan(*bounds(spec.parallelism))  # room for 3 replicas
    assert outcome.feasible and outcome.data == 2


def test_a_recovery_replan_from_part_of_a_replica_plans_afresh_instead_of_raising() -> None:
    """A drain evicted the gang's pods one by one: a pass saw 3 of 4 two-GPU pods of a tp2 x pp2
    gang (CI: 'RequestError: 3 pods of 2 GPUs is not a whole number of replicas' failed the pass)."""
    spec = TrainingJobSpec.model_validate({
        "image": "trainer:1", "parallelism": {"tensor": 2, "pipeline": 2, "data": 2},
        "worker": {"gpusPerPod": 2},
    })  # fmt: skip
    planner = PlacementPlanner(spec, Inventory.from_snapshot(h100(2), []))
    running = planner.plan(2, 2)
    assert running.feasible and len(running.assignments) == 4
    partial = {i: n for i, n in running.assignments.items() if i != 0}
    outcome = planner.replan(partial, frozenset(), 2, 2)
    assert outcome.feasible and outcome.mode == "full" and len(outcome.assignments) == 4
