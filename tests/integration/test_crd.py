"""The generated CRD on a real API server: validation, explain, columns, scale.

No operator runs here: these are the API server's answers alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from testbed.kube import Kube
from tests.example_manifests import (
    INVALID,
    INVALID_TEMPLATES,
    ROOT,
    VALID,
    VALID_TEMPLATES,
    expectation,
)

pytestmark = pytest.mark.integration

CRD = ROOT / "crds" / "topotrain.io_trainingjobs.yaml"


@pytest.fixture(scope="module")
def crd(kube: Kube) -> Iterator[None]:
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD.parent))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                 "crd/trainingjobs.topotrain.io", "crd/trainingjobtemplates.topotrain.io")
    yield


def job(name: str, data: int = 4, min_data: int | None = 2, tensor: int = 2, pipeline: int = 1,
        training: dict[str, object] | None = None, **parallelism_extra: object) -> str:
    parallelism: dict[str, object] = {"tensor": tensor, "pipeline": pipeline, "data": data,
                                      **parallelism_extra}
    if min_data is not None:
        parallelism["minData"] = min_data
    spec: dict[str, object] = {"image": "trainer:1", "parallelism": parallelism, "worker": {"gpusPerPod": 2}}
    if training is not None:
        spec["training"] = training
    return yaml.safe_dump({
        "apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name}, "spec": spec,
    })


def create(kube: Kube, namespace: str, manifest: str) -> None:
    path = Path(kube.kubeconfig).parent / f"manifest-{namespace}.yaml"
    path.write_text(manifest)
    kube.kubectl("-n", namespace, "create", "-f", str(path))


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_examples_are_accepted(kube: Kube, crd: None, namespace: str, path: Path) -> None:
    result = kube.kubectl("-n", namespace, "create", "-f", str(path), check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_are_rejected_naming_the_field(
    kube: Kube, crd: None, namespace: str, path: Path
) -> None:
    result = kube.kubectl("-n", namespace, "create", "-f", str(path), check=False)
    assert result.returncode != 0, f"{path.name} was accepted"
    assert expectation(path, "expect-field") in result.stderr, result.stderr
    assert expectation(path, "expect-message") in result.stderr, result.stderr


@pytest.mark.parametrize("path", [*VALID_TEMPLATES, *INVALID_TEMPLATES], ids=lambda p: p.name)
def test_templates_are_accepted_or_rejected_naming_the_field(kube: Kube, crd: None, path: Path) -> None:
    """TrainingJobTemplates are cluster-scoped: each is deleted again (they outlive namespaces)."""
    result = kube.kubectl("create", "-f", str(path), check=False)
    kube.kubectl("delete", "--ignore-not-found", "-f", str(path), check=False)
    if path in VALID_TEMPLATES:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode != 0, f"{path.name} was accepted"
    assert expectation(path, "expect-field") in result.stderr, result.stderr
    assert expectation(path, "expect-message") in result.stderr, result.stderr


def test_explain_teaches_the_api(kube: Kube, crd: None) -> None:
    out = kube.kubectl("explain", "trainingjob.spec.parallelism").stdout
    assert "Tensor-parallel degree" in out
    assert "minData" in out and "Elastic lower bound" in out
    out = kube.kubectl("explain", "tj.spec.topology.tensor").stdout
    assert "NVLink domain" in out
    for field, words in [("tj.spec.failurePolicy.rules.action", "RestartWithoutCounting"),
                         ("tj.spec.activeDeadlineSeconds", "DeadlineExceeded"),
                         ("tj.spec.ttlSecondsAfterFinished", "checkpoints in the store are kept"),
                         ("tj.spec.templateRef.followUpdates", "rolls the gang"),
                         ("tj.status.progress.eta", "Time left"),
                         ("trainingjobtemplate.spec.worker.gpusPerPod", "GPUs")]:
        assert words in kube.kubectl("explain", field).stdout, field


def test_get_shows_the_printer_columns(kube: Kube, crd: None, namespace: str) -> None:
    create(kube, namespace, job("columns"))
    header = kube.kubectl("-n", namespace, "get", "tj").stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "TP", "PP", "DP", "POOL", "RESTARTS", "CHECKPOINT",
                      "PROGRESS", "ETA", "RECOVERY", "REASON", "AGE"]
    listed = kube.kubectl("-n", namespace, "get", "all").stdout
    assert "trainingjob.topotrain.io/columns" in listed  # category `all`


def spec_data(kube: Kube, namespace: str, name: str) -> int:
    out = kube.kubectl("-n", namespace, "get", "tj", name, "-o", "json").stdout
    value: int = json.loads(out)["spec"]["parallelism"]["data"]
    return value


def test_scale_resizes_data_parallelism_within_min_data(
    kube: Kube, crd: None, namespace: str
) -> None:
    create(kube, namespace, job("scaled", data=4, min_data=2))
    kube.kubectl("-n", namespace, "scale", "tj/scaled", "--replicas=3")
    assert spec_data(kube, namespace, "scaled") == 3
    below = kube.kubectl("-n", namespace, "scale", "tj/scaled", "--replicas=1", check=False)
    assert below.returncode != 0
    assert "minData must be <= data" in below.stderr
    assert spec_data(kube, namespace, "scaled") == 3


def test_scale_refuses_a_data_degree_the_bundled_trainer_rejects(
    kube: Kube, crd: None, namespace: str
) -> None:
    """globalBatch 64 in microbatches of 2 splits over 4 or 2 replicas, never over 3."""
    create(kube, namespace, job("batch", data=4, min_data=2, training={"globalBatch": 64, "model": "tiny"}))
    refused = kube.kubectl("-n", namespace, "scale", "tj/batch", "--replicas=3", check=False)
    assert refused.returncode != 0
    assert "spec.parallelism.data: Invalid value" in refused.stderr, refused.stderr
    assert ("spec.parallelism.data is not an allowed data degree: training.globalBatch must be a "
            "multiple of training.microBatch*data") in refused.stderr, refused.stderr
    # the job's own settings (64), not only the defaults, are what the rule was checked with
    assert "both as this job sets them" in refused.stderr, refused.stderr
    assert spec_data(kube, namespace, "batch") == 4
    kube.kubectl("-n", namespace, "scale", "tj/batch", "--replicas=2")
    assert spec_data(kube, namespace, "batch") == 2
    out = kube.kubectl("-n", namespace, "get", "tj", "batch", "-o", "json").stdout
    assert json.loads(out)["spec"]["training"] == {"globalBatch": 64, "model": "tiny"}  # kept as given


@pytest.mark.parametrize(
    ("manifest", "field", "message"),
    [
        (job("onef", data=4, min_data=None, pipeline=2, training={"globalBatch": 8}),
         "spec.parallelism.data", "the 1f1b schedule needs at least pipeline microbatches per step"),
        (job("lowbound", data=4, min_data=3, training={"globalBatch": 64}),
         "spec.parallelism.minData", "spec.parallelism.minData is not an allowed data degree"),
        (job("multiple", data=6, min_data=None, dataMultiple=4),
         "spec.parallelism.data", "must be a multiple of dataMultiple"),
        (job("listed", data=4, min_data=1, allowedData=[2, 4]),
         "spec.parallelism.minData", "must be one of allowedData"),
        (job("zero", data=4, min_data=None, training={"microBatch": 0}),
         "spec.training.microBatch", "should be greater than or equal to 1"),
    ],
)
def test_create_refuses_data_degrees_that_can_never_run(
    kube: Kube, crd: None, namespace: str, manifest: str, field: str, message: str
) -> None:
    path = Path(kube.kubeconfig).parent / f"manifest-{namespace}.yaml"
    path.write_text(manifest)
    result = kube.kubectl("-n", namespace, "create", "-f", str(path), check=False)
    assert result.returncode != 0
    assert field in result.stderr and message in result.stderr, result.stderr


def test_scale_keeps_to_data_multiple(kube: Kube, crd: None, namespace: str) -> None:
    create(kube, namespace, job("mine", data=8, min_data=4, dataMultiple=4, training={"lr": 0.1}))
    refused = kube.kubectl("-n", namespace, "scale", "tj/mine", "--replicas=6", check=False)
    assert refused.returncode != 0
    assert "spec.parallelism.data" in refused.stderr and "multiple of dataMultiple" in refused.stderr
    kube.kubectl("-n", namespace, "scale", "tj/mine", "--replicas=4")
    assert spec_data(kube, namespace, "mine") == 4


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"spec": {"parallelism": {"tensor": 4}}}, "spec.parallelism.tensor"),
        ({"spec": {"parallelism": {"pipeline": 2}}}, "spec.parallelism.pipeline"),
        ({"spec": {"rankOrder": "tp-dp-pp"}}, "spec.rankOrder"),
        ({"spec": {"worker": {"gpusPerPod": 4}}}, "spec.worker.gpusPerPod"),
        ({"spec": {"managedBy": "kueue.x-k8s.io/multikueue"}}, "spec.managedBy"),
    ],
)
def test_immutable_fields_cannot_change(
    kube: Kube, crd: None, namespace: str, patch: dict[str, object], field: str
) -> None:
    create(kube, namespace, job("frozen"))
    result = kube.kubectl("-n", namespace, "patch", "tj", "frozen", "--type=merge",
                          "-p", json.dumps(patch), check=False)
    assert result.returncode != 0
    assert field in result.stderr and "is immutable after creation" in result.stderr


def test_defaults_are_applied_by_the_api_server(kube: Kube, crd: None, namespace: str) -> None:
    create(kube, namespace, job("defaults"))
    spec = json.loads(kube.kubectl("-n", namespace, "get", "tj", "defaults", "-o", "json").stdout)["spec"]
    assert spec["rankOrder"] == "tp-pp-dp"
    assert spec["topology"] == {"tensor": "Required", "pipeline": "Preferred", "data": "Preferred"}
    assert spec["failurePolicy"]["maxRestarts"] == 20


def test_pass_through_fields_are_stored_whole_and_keep_clear_of_the_operators(
    kube: Kube, crd: None, namespace: str
) -> None:
    worker: dict[str, object] = {
        "gpusPerPod": 2,
        "volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
                    {"name": "hf-cache", "ephemeral": {"volumeClaimTemplate": {"spec": {
                        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Ti"}}}}}}],
        "volumeMounts": [{"name": "datasets", "mountPath": "/datasets", "readOnly": True},
                         {"name": "hf-cache", "mountPath": "/cache", "subPath": "hub"}],
        "imagePullSecrets": ["registry"],
        "labels": {"team": "llm"},
        "annotations": {"example.com/owner": "ml-platform"},
    }
    manifest = yaml.safe_load(job("passed"))
    manifest["spec"]["worker"] = worker
    create(kube, namespace, yaml.safe_dump(manifest))
    stored = json.loads(kube.kubectl("-n", namespace, "get", "tj", "passed", "-o", "json").stdout)
    assert {k: v for k, v in stored["spec"]["worker"].items() if k in worker} == worker, "nothing pruned"
    patch = {"spec": {"worker": {"volumes": [{"name": "dshm", "emptyDir": {}}], "volumeMounts": None}}}
    refused = kube.kubectl("-n", namespace, "patch", "tj", "passed", "--type=merge",
                           "-p", json.dumps(patch), check=False)
    assert refused.returncode != 0
    assert "spec.worker.volumes[0].name" in refused.stderr, refused.stderr
    assert "must not be dshm or topotrain-control" in refused.stderr, refused.stderr
