"""TrainingJobTemplate (topotrain.io/v1alpha1, cluster-scoped): any part of a TrainingJob spec,
owned by the platform, that a job names with `spec.templateRef`.

Its schema is the TrainingJob spec's (`model_schema(TrainingJobSpec)`, the same pydantic
models), with every field optional and no defaults: a template holds only what it sets. The
rules that read several fields (the mesh against gpusPerPod, a mount against the volumes) and
immutability are left to the merged spec, which the operator validates with the models' Python
twins before it plans from it.

The merge (`merge`): the job's spec over the template's, field by field, recursively through
objects and maps (`worker`, `worker.resources.requests`, `training`, labels, ...). The job wins
every field it sets. A list is one value: the job's whole list if it sets one, else the
template's (lists are never merged item by item). Because the API server stores a field a job
leaves out with its default, a job field equal to the CRD's default counts as unset: the
template's value is used (a job cannot ask for the default back over a template's value).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from functools import cache
from typing import Any

import yaml
from pydantic import ValidationError

from topotrain import GROUP, TEMPLATE_KIND, TEMPLATE_PLURAL, VERSION
from topotrain.api.crd import model_schema
from topotrain.api.spec import TrainingJobSpec

TEMPLATE_CRD_FILENAME = f"{GROUP}_{TEMPLATE_PLURAL}.yaml"
_IMMUTABLE = "self == oldSelf"

Schema = dict[str, Any]


@cache
def job_spec_schema() -> Schema:
    """The TrainingJob spec's structural schema (its defaults decide what a job left out)."""
    return model_schema(TrainingJobSpec)


def merge(template: Any, job: Any, schema: Mapping[str, Any] | None = None) -> Any:
    """`job` over `template`, field by field (the module's rule); `schema`: the job's, for its
    defaults."""
    node = job_spec_schema() if schema is None else schema
    if isinstance(template, Mapping) and isinstance(job, Mapping):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties") if isinstance(node.get("additionalProperties"), dict) else {}
        out = dict(template)
        for key, value in job.items():
            child = props.get(key, extra)
            out[key] = merge(template[key], value, child) if key in template else value
        return out
    if "default" in node and job == node["default"]:
        return template
    return job


def _template_node(node: Any, in_list: bool = False) -> Any:
    """A job schema node as a template's: optional fields, no defaults, no cross-field or
    immutability rules (list items keep their own)."""
    if isinstance(node, list):
        return [_template_node(item, in_list) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "items":
            out[key] = _template_node(value, True)
        elif key in ("properties", "additionalProperties") and isinstance(value, dict):
            out[key] = ({k: _template_node(v, in_list) for k, v in value.items()} if key == "properties"
                        else _template_node(value, in_list))
        elif key == "x-kubernetes-validations":
            kept = [r for r in value if r["rule"] != _IMMUTABLE and (in_list or "properties" not in node)]
            if kept:
                out[key] = kept
        elif key in ("required", "default") and not in_list:
            continue
        else:
            out[key] = value
    return out


def template_spec_schema() -> Schema:
    schema = _template_node(copy.deepcopy(job_spec_schema()))
    schema["properties"].pop("templateRef", None)
    # Who runs a job is the job's own word: topotrain and Kueue's MultiKueue read spec.managedBy
    # off the job object itself, never off a template (docs/multicluster.md).
    schema["properties"].pop("managedBy", None)
    schema["description"] = ("Any part of a TrainingJob spec: what the jobs naming this template "
                             "start from (their own fields win).")
    return schema  # type: ignore[no-any-return]


def build_template_crd() -> dict[str, Any]:
    root = {
        "type": "object",
        "description": "A TrainingJobTemplate holds the platform's part of TrainingJob specs "
        "(image, worker, topology, checkpoint, failure policy, training defaults); a TrainingJob "
        "names one with spec.templateRef.",
        "properties": {
            "apiVersion": {"type": "string", "description": "topotrain.io/v1alpha1"},
            "kind": {"type": "string", "description": TEMPLATE_KIND},
            "metadata": {"type": "object"},
            "spec": template_spec_schema(),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{TEMPLATE_PLURAL}.{GROUP}", "labels": {
            "app.kubernetes.io/name": "topotrain", "app.kubernetes.io/part-of": "topotrain"}},
        "spec": {
            "group": GROUP,
            "names": {"kind": TEMPLATE_KIND, "listKind": f"{TEMPLATE_KIND}List", "plural": TEMPLATE_PLURAL,
                      "singular": TEMPLATE_KIND.lower(), "shortNames": ["tjt"], "categories": ["topotrain"]},
            "scope": "Cluster",
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": root},
                "additionalPrinterColumns": [
                    {"name": "Image", "type": "string", "jsonPath": ".spec.image"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
            }],
        },
    }


def render_template_crd() -> str:
    header = "# Generated by `topotrain crd` from operator/topotrain/api/job_template.py. Do not edit.\n"
    return header + yaml.safe_dump(build_template_crd(), sort_keys=False, width=100)


def problems(exc: ValidationError, where: str) -> str:
    """A validation error's problems, each naming its field, and where the spec came from."""
    said = []
    for err in exc.errors()[:3]:
        path = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        said.append(f"{path}: {err['msg']}")
    return f"{'; '.join(said)} ({where})"


def resolve(job: Mapping[str, Any], template: Mapping[str, Any], name: str,
            generation: int) -> tuple[TrainingJobSpec | None, str]:
    """(the job's spec merged over the template's, "") or (None, the problems naming fields)."""
    merged = merge(dict(template), dict(job))
    try:
        return TrainingJobSpec.model_validate(merged), ""
    except ValidationError as exc:
        return None, problems(exc, f"the job's spec merged over TrainingJobTemplate {name} "
                                   f"generation {generation}")


def template_problems(spec: Mapping[str, Any]) -> list[str]:
    """A template's spec checked on its own, each problem naming its field: merged under a job
    that sets only what the template does not (image, a one-replica mesh that fits its pods)."""
    if "templateRef" in spec:
        return ["spec.templateRef: a template cannot name another template"]
    given = (spec.get("worker") or {}).get("gpusPerPod")
    gpus = given if isinstance(given, int) and given > 0 else 8
    base = {"image": "job-image", "parallelism": {"tensor": gpus, "pipeline": 1, "data": 1}}
    try:
        TrainingJobSpec.model_validate({**base, **spec})
    except ValidationError as exc:
        return [problems(exc, "TrainingJobTemplate").rsplit(" (", 1)[0]]
    return []
