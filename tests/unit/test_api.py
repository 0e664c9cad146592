"""Model-level validation: every rule the CRD enforces, checked in Python too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from topotrain.api import TrainingJobSpec, validate_manifest

from tests.example_manifests import INVALID, VALID, expectation


def base(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "image": "trainer:1",
        "parallelism": {"tensor": 2, "pipeline": 2, "data": 2},
        "worker": {"gpusPerPod": 2},
    }
    spec.update(overrides)
    return {"apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "job"}, "spec": spec}


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    assert validate_manifest(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_are_rejected_naming_the_field(path: Path) -> None:
    problems = validate_manifest(yaml.safe_load(path.read_text()))
    field = expectation(path, "expect-field")
    assert any(field in problem for problem in problems), problems


def test_there_is_an_invalid_example_per_rule() -> None:
    fields = {expectation(p, "expect-field") for p in INVALID}
    assert {
        "spec.parallelism.tensor", "spec.parallelism.pipeline", "spec.parallelism.data",
        "spec.parallelism.minData", "spec.worker.gpusPerPod", "spec.checkpoint.uri",
        "spec.failurePolicy.maxRestarts", "spec.rankOrder",
    } <= fields


@pytest.mark.parametrize(
    ("parallelism", "gpus_per_pod", "error"),
    [
        ({"tensor": 8, "pipeline": 4, "data": 16}, 8, None),
        ({"tensor": 16, "pipeline": 1, "data": 2}, 4, None),  # multi-node TP group (NVL72)
        ({"tensor": 1, "pipeline": 3, "data": 1}, 3, None),
        ({"tensor": 2, "pipeline": 1, "data": 3}, 4, "gpusPerPod (4) must divide"),
        ({"tensor": 3, "pipeline": 2, "data": 1}, 2, "tensor (3) must divide"),
        ({"tensor": 6, "pipeline": 1, "data": 2}, 4, "tensor (6) must divide"),
        ({"tensor": 1, "pipeline": 1, "data": 4, "minData": 5}, 1, "minData (5) must be <="),
        ({"tensor": 1, "pipeline": 1, "data": 4, "minData": 4}, 1, None),
        ({"tensor": 0, "pipeline": 1, "data": 1}, 1, "greater than or equal to 1"),
        ({"tensor": 1, "pipeline": 1, "data": -2}, 1, "greater than or equal to 1"),
        ({"tensor": 8, "pipeline": 8, "data": 1024}, 8, None),  # 65536 ranks: the cap
        ({"tensor": 8, "pipeline": 16, "data": 1024}, 8, "(131072) must be at most 65536 ranks"),
    ],
)
def test_mesh_rules(parallelism: dict[str, int], gpus_per_pod: int, error: str | None) -> None:
    problems = validate_manifest(base(parallelism=parallelism, worker={"gpusPerPod": gpus_per_pod}))
    if error is None:
        assert problems == []
    else:
        assert any(error in p for p in problems), problems


def test_defaults_match_the_design() -> None:
    spec = TrainingJobSpec.model_validate(base()["spec"])
    assert spec.rank_order == "tp-pp-dp"
    assert spec.topology.tensor == "Required"
    assert spec.topology.pipeline == "Preferred"
    assert spec.parallelism.effective_min_data == 2
    assert spec.failure_policy.max_restarts == 20
    assert spec.failure_policy.non_retryable_exit_codes == [78]
    assert spec.pods == 4


@pytest.mark.parametrize(
    ("name", "ok"),
    [("job", True), ("a" * 45, True), ("a" * 46, False), ("Job", False), ("9job", False), ("job-", False)],
)
def test_name_rule(name: str, ok: bool) -> None:
    manifest = base()
    manifest["metadata"]["name"] = name
    assert (validate_manifest(manifest) == []) is ok


def test_unknown_field_is_named() -> None:
    problems = validate_manifest(base(worker={"gpusPerPod": 2, "gpuPerPod": 4}))
    assert any("spec.worker.gpuPerPod" in p for p in problems), problems


def test_wire_round_trip_keeps_camel_case() -> None:
    spec = TrainingJobSpec.model_validate(base(checkpoint={"uri": "s3://b/p", "intervalSteps": 5})["spec"])
    wire = spec.to_wire()
    assert wire["checkpoint"]["intervalSteps"] == 5
    assert wire["worker"]["gpusPerPod"] == 2
    assert TrainingJobSpec.model_validate(wire) == spec
