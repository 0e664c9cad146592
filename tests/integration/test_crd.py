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
from tests.example_manifests import INVALID, ROOT, VALID, expectation

pytestmark = pytest.mark.integration

CRD = ROOT / "crds" / "topotrain.io_trainingjobs.yaml"


@pytest.fixture(scope="module")
def crd(kube: Kube) -> Iterator[None]:
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                 "crd/trainingjobs.topotrain.io")
    yield


def job(name: str, data: int = 4, min_data: int | None = 2, tensor: int = 2) -> str:
    parallelism = {"tensor": tensor, "pipeline": 1, "data": data}
    if min_data is not None:
        parallelism["minData"] = min_data
    return yaml.safe_dump({
        "apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {"image": "trainer:1", "parallelism": parallelism, "worker": {"gpusPerPod": 2}},
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


def test_explain_teaches_the_api(kube: Kube, crd: None) -> None:
    out = kube.kubectl("explain", "trainingjob.spec.parallelism").stdout
    assert "Tensor-parallel degree" in out
    assert "minData" in out and "Elastic lower bound" in out
    out = kube.kubectl("explain", "tj.spec.topology.tensor").stdout
    assert "NVLink domain" in out


def test_get_shows_the_printer_columns(kube: Kube, crd: None, namespace: str) -> None:
    create(kube, namespace, job("columns"))
    header = kube.kubectl("-n", namespace, "get", "tj").stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "TP", "PP", "DP", "POOL", "RESTARTS", "CHECKPOINT",
                      "RECOVERY", "AGE"]
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


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"spec": {"parallelism": {"tensor": 4}}}, "spec.parallelism.tensor"),
        ({"spec": {"parallelism": {"pipeline": 2}}}, "spec.parallelism.pipeline"),
        ({"spec": {"rankOrder": "tp-dp-pp"}}, "spec.rankOrder"),
        ({"spec": {"worker": {"gpusPerPod": 4}}}, "spec.worker.gpusPerPod"),
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
