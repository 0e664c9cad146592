"""Model-level validation: every rule the CRD enforces, checked in Python too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from topotrain.api.job_template import template_problems
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.validation import validate_manifest

from tests.example_manifests import INVALID, INVALID_TEMPLATES, VALID, VALID_TEMPLATES, expectation


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


@pytest.mark.parametrize("path", VALID_TEMPLATES, ids=lambda p: p.name)
def test_example_templates_are_valid(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["kind"] == "TrainingJobTemplate" and template_problems(doc["spec"]) == []


@pytest.mark.parametrize("path", INVALID_TEMPLATES, ids=lambda p: p.name)
def test_invalid_templates_are_rejected_naming_the_field(path: Path) -> None:
    problems = template_problems(yaml.safe_load(path.read_text())["spec"])
    assert any(expectation(path, "expect-field") in problem for problem in problems), problems


def test_there_is_an_invalid_example_per_rule() -> None:
    fields = {expectation(p, "expect-field") for p in INVALID}
    assert {
        "spec.parallelism.tensor", "spec.parallelism.pipeline", "spec.parallelism.data",
        "spec.parallelism.minData", "spec.worker.gpusPerPod", "spec.checkpoint.uri",
        "spec.failurePolicy.maxRestarts", "spec.rankOrder", "spec.worker.volumes[0].name",
        "spec.worker.volumes[1]", "spec.worker.volumeMounts", "spec.worker.volumeMounts[0].mountPath",
        "spec.worker.labels", "spec.worker.annotations", "spec.image",
        "spec.failurePolicy.rules", "spec.failurePolicy.rules[0].action",
        "spec.failurePolicy.rules[0].onExitCodes", "spec.activeDeadlineSeconds",
        "spec.ttlSecondsAfterFinished",
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


DATA = {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}
AT_DATA = {"name": "data", "mountPath": "/data", "readOnly": True}


@pytest.mark.parametrize(
    ("worker", "error"),
    [
        ({"volumes": [DATA], "volumeMounts": [AT_DATA], "imagePullSecrets": ["registry"],
          "labels": {"team": "llm", "topology.topotrain.io/rack": "r1"},
          "annotations": {"example.com/owner": "ml-platform"}}, None),
        ({"volumes": [DATA, {"name": "dshm", "emptyDir": {}}]},
         "spec.worker.volumes[1].name: Value error, must not be dshm or topotrain-control"),
        ({"volumes": [{"name": "topotrain-control", "emptyDir": {}}]}, "spec.worker.volumes[0].name"),
        ({"volumes": [{"emptyDir": {}}]}, "spec.worker.volumes[0].name: Field required"),
        ({"volumes": [{"name": "Data", "emptyDir": {}}]}, "spec.worker.volumes[0].name: String should match"),
        ({"volumes": [DATA, {"name": "data", "emptyDir": {}}]},
         "spec.worker.volumes[1].name: Duplicate value 'data' (spec.worker.volumes[0] has it)"),
        ({"volumes": [DATA], "volumeMounts": [{**AT_DATA, "mountPath": "/dev/shm"}]},
         "spec.worker.volumeMounts[0].mountPath: Value error, must not be /dev/shm or /etc/topotrain"),
        ({"volumes": [DATA], "volumeMounts": [{**AT_DATA, "mountPath": "/dev/shm/"}]},
         "spec.worker.volumeMounts[0].mountPath"),
        ({"volumes": [DATA], "volumeMounts": [{**AT_DATA, "mountPath": "/etc/topotrain/annotations"}]},
         "spec.worker.volumeMounts[0].mountPath"),
        ({"volumes": [DATA], "volumeMounts": [{**AT_DATA, "mountPath": "/dev/shmem"}]}, None),
        ({"volumes": [DATA], "volumeMounts": [{**AT_DATA, "mountPath": "/etc"}]}, None),
        ({"volumes": [DATA], "volumeMounts": [{"name": "data"}]},
         "spec.worker.volumeMounts[0].mountPath: Field required"),
        ({"volumes": [DATA], "volumeMounts": [AT_DATA, {**AT_DATA, "name": "model"}]},
         "spec.worker.volumeMounts[1].name: 'model' is not in spec.worker.volumes"),
        ({"volumeMounts": [AT_DATA]}, "spec.worker.volumeMounts[0].name: 'data' is not in spec.worker.volumes"),
        ({"volumes": [DATA], "volumeMounts": [AT_DATA, {**AT_DATA, "readOnly": False}]},
         "spec.worker.volumeMounts[1].mountPath: Duplicate value '/data'"),
        ({"imagePullSecrets": [""]}, "spec.worker.imagePullSecrets[0]: String should have at least 1 character"),
        ({"labels": {"topotrain.io/job": "other", "team": "llm"}},
         "spec.worker.labels: Value error, must not set a label the operator sets (topotrain.io/ keys, "
         "app.kubernetes.io/managed-by): topotrain.io/job"),
        ({"labels": {"app.kubernetes.io/managed-by": "me"}}, "spec.worker.labels"),
        ({"annotations": {"topotrain.io/checkpoint-request": "1"}},
         "spec.worker.annotations: Value error, must not set an annotation the operator sets"),
        ({"annotations": {"app.kubernetes.io/managed-by": "me"}}, None),
    ],
)
def test_pass_through_rules(worker: dict[str, Any], error: str | None) -> None:
    problems = validate_manifest(base(worker={"gpusPerPod": 2, **worker}))
    if error is None:
        assert problems == []
    else:
        assert any(error in p for p in problems), problems


def test_all_volume_problems_are_named_at_once() -> None:
    worker = {"gpusPerPod": 2, "volumes": [DATA, DATA], "volumeMounts": [{**AT_DATA, "name": "model"}]}
    (problem,) = validate_manifest(base(worker=worker))
    assert "spec.worker.volumes[1].name" in problem and "spec.worker.volumeMounts[0].name" in problem
