"""The one rule for which data degrees a job can run at (topotrain.degrees)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.validation import degree_rule, limits_for, spec_problems, validate_manifest
from topotrain.degrees import REASON, BatchRule, DataLimits, DegreeRule

from tests.example_manifests import ROOT

ELASTIC = ROOT / "examples" / "elastic-two-pools.yaml"


def spec(parallelism: dict[str, Any], training: dict[str, Any] | None = None,
         gpus_per_pod: int = 1) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "trainer:1", "parallelism": parallelism, "worker": {"gpusPerPod": gpus_per_pod},
        "training": training or {},
    })


@pytest.mark.parametrize(
    ("parallelism", "training", "gpus_per_pod", "low", "high", "allowed"),
    [
        # whole pods only: no batch stated, no limits
        ({"tensor": 2, "pipeline": 1, "data": 16}, None, 8, 1, 16, [16, 12, 8, 4]),
        ({"tensor": 1, "pipeline": 1, "data": 7}, None, 1, 1, 7, [7, 6, 5, 4, 3, 2, 1]),
        # the shipped elastic example: globalBatch 64, microBatch 2 (default), 1f1b, pp=2
        ({"tensor": 4, "pipeline": 2, "data": 4, "minData": 2}, {"globalBatch": 64}, 4, 2, 4, [4, 2]),
        # 1f1b needs >= pipeline microbatches: 16/(2*d) >= 4 leaves d <= 2
        ({"tensor": 1, "pipeline": 4, "data": 8}, {"globalBatch": 16}, 1, 1, 8, [2, 1]),
        # gpipe has no such floor
        ({"tensor": 1, "pipeline": 4, "data": 8}, {"globalBatch": 16, "schedule": "gpipe"}, 1, 1, 8,
         [8, 4, 2, 1]),
        # microBatch alone states a batch: globalBatch takes the trainer's default (16)
        ({"tensor": 1, "pipeline": 1, "data": 16}, {"microBatch": 1}, 1, 1, 16, [16, 8, 4, 2, 1]),
        # snake_case keys, as the trainer also accepts them
        ({"tensor": 1, "pipeline": 1, "data": 8}, {"global_batch": 24, "micro_batch": 3}, 1, 1, 8,
         [8, 4, 2, 1]),
        # a trainer of one's own: dataMultiple, allowedData
        ({"tensor": 1, "pipeline": 1, "data": 12, "dataMultiple": 4}, None, 1, 1, 12, [12, 8, 4]),
        ({"tensor": 1, "pipeline": 1, "data": 16, "allowedData": [1, 2, 4, 16]}, None, 1, 1, 16,
         [16, 4, 2, 1]),
        # every rule at once
        ({"tensor": 2, "pipeline": 1, "data": 12, "dataMultiple": 2, "allowedData": [2, 3, 4, 6, 12]},
         {"globalBatch": 48, "microBatch": 4}, 4, 1, 12, [12, 6, 4, 2]),
    ],
)
def test_allowed_degrees(parallelism: dict[str, Any], training: dict[str, Any] | None,
                         gpus_per_pod: int, low: int, high: int, allowed: list[int]) -> None:
    rule = degree_rule(spec(parallelism, training, gpus_per_pod))
    assert rule.degrees(low, high) == allowed


@pytest.mark.parametrize(
    ("rule", "data", "names"),
    [
        (DegreeRule(4, 2, 4), 3, None),  # 24 ranks: 6 whole pods
        (DegreeRule(1, 1, 4), 3, "spec.worker.gpusPerPod=4 must divide tensor*pipeline*data=1*1*3"),
        (DegreeRule(limits=DataLimits(multiple=4)), 6, "spec.parallelism.dataMultiple=4"),
        (DegreeRule(limits=DataLimits(allowed=(8, 2))), 4, "spec.parallelism.allowedData is [2, 8]"),
        (DegreeRule(limits=DataLimits(batch=BatchRule(64, 2))), 3,
         "training.globalBatch=64 must be a multiple of microBatch*data=2*3"),
        (DegreeRule(pipeline=4, limits=DataLimits(batch=BatchRule(16, 2, pipeline=4))), 4,
         "1F1B needs at least pipeline=4 microbatches per step; globalBatch/(microBatch*data)=2"),
    ],
)
def test_a_refused_degree_names_the_field(rule: DegreeRule, data: int, names: str | None) -> None:
    assert rule.allows(data) is (names is None)
    assert (rule.problem(data) or "").startswith(names or "")


def test_no_batch_stated_means_no_batch_rule() -> None:
    """A trainer of one's own takes spec.training as it likes: only a stated batch applies."""
    assert BatchRule.from_training({"model": "mine", "lr": 0.1}, pipeline=4) is None
    assert limits_for(spec({"data": 3}, {"model": "tiny"})).batch is None


@pytest.mark.parametrize("value", [0, -4, "64", True, 2.5])
def test_a_batch_that_is_not_a_positive_integer_is_reported(value: object) -> None:
    problems = spec_problems(spec({"data": 2}, {"globalBatch": value}))
    assert problems == [f"spec.training.globalBatch={value!r} must be an integer >= 1"]


@pytest.mark.parametrize(
    ("parallelism", "expected"),
    [
        ({"tensor": 4, "pipeline": 2, "data": 4, "minData": 2}, []),
        ({"tensor": 4, "pipeline": 2, "data": 3, "minData": 2},
         ["spec.parallelism.data=3 is not an allowed data degree: training.globalBatch=64 must be a "
          "multiple of microBatch*data=2*3; nearest allowed: 2, 4"]),
        ({"tensor": 4, "pipeline": 2, "data": 4, "minData": 3},
         ["spec.parallelism.minData=3 is not an allowed data degree: training.globalBatch=64 must be "
          "a multiple of microBatch*data=2*3; nearest allowed: 2, 4"]),
    ],
)
def test_spec_problems_for_the_elastic_example(parallelism: dict[str, Any], expected: list[str]) -> None:
    """What the reconciler reports (ConfigValid=False) for a spec stored before the rule."""
    assert spec_problems(spec(parallelism, {"globalBatch": 64}, gpus_per_pod=4)) == expected


def test_explain_says_why_no_degree_in_range_can_run() -> None:
    rule = degree_rule(spec({"tensor": 4, "pipeline": 2, "data": 3}, {"globalBatch": 64}, 4))
    assert rule.degrees(3, 3) == []
    assert rule.explain(3, 3) == (
        "no allowed data degree in [3, 3] (at data=3: training.globalBatch=64 must be a multiple of "
        "microBatch*data=2*3); allowed degrees near it: 2, 4"
    )
    assert REASON == "DataDegreeNotAllowed"


@pytest.mark.parametrize(
    ("parallelism", "field"),
    [
        ({"tensor": 4, "pipeline": 2, "data": 3, "minData": 2}, "spec.parallelism.data=3"),
        ({"tensor": 4, "pipeline": 2, "data": 4, "minData": 3}, "spec.parallelism.minData=3"),
        ({"tensor": 4, "pipeline": 2, "data": 4, "minData": 2, "dataMultiple": 4},
         "spec.parallelism.minData=2"),
        ({"tensor": 4, "pipeline": 2, "data": 4, "allowedData": [2, 8]}, "spec.parallelism.data=4"),
    ],
)
def test_validate_manifest_refuses_what_can_never_run(parallelism: dict[str, Any], field: str) -> None:
    manifest = yaml.safe_load(ELASTIC.read_text())
    manifest["spec"]["parallelism"] = parallelism
    problems = validate_manifest(manifest)
    assert len(problems) == 1 and problems[0].startswith(field), problems
