"""The checked-in CRD is what the models generate, and it teaches the API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from topotrain.api.crd import CRD_FILENAME, build_crd, render_crd
from topotrain.api.job_template import (
    TEMPLATE_CRD_FILENAME,
    build_template_crd,
    render_template_crd,
)

ROOT = Path(__file__).resolve().parents[2]
RENDERED = [(CRD_FILENAME, render_crd), (TEMPLATE_CRD_FILENAME, render_template_crd)]


@pytest.mark.parametrize(("filename", "render"), RENDERED, ids=[f for f, _ in RENDERED])
def test_checked_in_crd_matches_the_models(filename: str, render: Any) -> None:
    checked_in = (ROOT / "crds" / filename).read_text()
    assert checked_in == render(), "crds/ is stale: run `make crds`"


@pytest.mark.parametrize("filename", [f for f, _ in RENDERED])
def test_chart_crd_matches_top_level_crd(filename: str) -> None:
    chart_crd = ROOT / "charts" / "topotrain" / "crds" / filename
    assert chart_crd.read_text() == (ROOT / "crds" / filename).read_text(), "run `make crds`"


def _walk(node: dict[str, Any], path: str) -> list[str]:
    missing = []
    for name, child in node.get("properties", {}).items():
        here = f"{path}.{name}"
        if name != "metadata" and not child.get("description"):
            missing.append(here)
        missing += _walk(child, here)
    items = node.get("items")
    if isinstance(items, dict):
        missing += _walk(items, f"{path}[]")
    return missing


def schema() -> dict[str, Any]:
    crd = build_crd()
    result: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return result


def test_every_field_has_a_description() -> None:
    assert _walk(schema(), "") == []
    template = build_template_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _walk(template, "") == []


def test_a_template_sets_only_what_it_holds() -> None:
    """No required field and no default outside list items (a template holds what it sets), no
    immutability and no rule across fields (the merged spec is checked), no templateRef."""
    spec = build_template_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def walk(node: dict[str, Any], path: str) -> list[str]:
        bad = [f"{path}: {key}" for key in ("required", "default") if key in node]
        bad += [f"{path}: {r['rule']}" for r in node.get("x-kubernetes-validations", [])
                if r["rule"] == "self == oldSelf" or "properties" in node]
        for name, child in node.get("properties", {}).items():
            bad += walk(child, f"{path}.{name}")
        return bad

    assert walk(spec, "spec") == [] and "templateRef" not in spec["properties"]
    # managedBy is the job's own word (read off the job by topotrain and MultiKueue), never a template's
    assert set(spec["properties"]) == set(schema()["properties"]["spec"]["properties"]) - {"templateRef", "managedBy"}


def test_only_training_and_core_objects_passed_through_are_free_form() -> None:
    def free_form(node: dict[str, Any], path: str) -> list[str]:
        found = [path] if node.get("x-kubernetes-preserve-unknown-fields") else []
        for name, child in node.get("properties", {}).items():
            found += free_form(child, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            found += free_form(node["items"], f"{path}[]")
        return found

    assert free_form(schema()["properties"]["spec"], "spec") == [
        "spec.env[].valueFrom", "spec.worker.securityContext", "spec.worker.env[].valueFrom",
        "spec.worker.volumes[]", "spec.worker.volumeMounts[]", "spec.training",
    ]


def test_structural_schema_has_no_unions_or_refs() -> None:
    def bad(node: Any, path: str) -> list[str]:
        if isinstance(node, list):
            return [p for i, item in enumerate(node) for p in bad(item, f"{path}[{i}]")]
        if not isinstance(node, dict):
            return []
        found = []
        if "$ref" in node or node.get("type") == "null":
            found.append(path)
        if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
            found.append(path)
        return found + [p for k, v in node.items() for p in bad(v, f"{path}.{k}")]

    assert bad(schema(), "") == []


def test_scale_subresource_points_at_data_parallelism() -> None:
    version = build_crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.parallelism.data"
    assert scale["statusReplicasPath"] == ".status.parallelism.data"
    assert "status" in version["subresources"]


def test_immutable_fields_carry_transition_rules() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    for node in (
        spec["parallelism"]["properties"]["tensor"],
        spec["parallelism"]["properties"]["pipeline"],
        spec["rankOrder"],
        spec["worker"]["properties"]["gpusPerPod"],
        spec["managedBy"],
    ):
        rules = [v["rule"] for v in node["x-kubernetes-validations"]]
        assert "self == oldSelf" in rules
    # managedBy can be neither added nor removed either (a rule on the spec, which has oldSelf)
    spec_rules = [v["rule"] for v in schema()["properties"]["spec"]["x-kubernetes-validations"]]
    assert "has(self.managedBy) == has(oldSelf.managedBy)" in spec_rules
