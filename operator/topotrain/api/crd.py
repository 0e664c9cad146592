"""Generate the TrainingJob CustomResourceDefinition from the pydantic models.

pydantic's JSON schema is turned into a structural OpenAPI v3 schema: refs
inlined, Optional[X] collapsed to X, titles dropped, and our CEL rules, list
and map markers kept. `crds/topotrain.io_trainingjobs.yaml` is this output,
checked in; a unit test fails when the two differ.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from topotrain import GROUP, KIND, PLURAL, VERSION
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import TrainingJobStatus
from topotrain.api.validation import CRD_PARALLELISM_RULES, CRD_SPEC_RULES, MANAGED_BY_RULE

CRD_FILENAME = f"{GROUP}_{PLURAL}.yaml"
NAME_RULE = {
    "rule": "self.metadata.name.size() <= 45 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    "message": "metadata.name must be a DNS-1035 label of at most 45 characters "
    "(pods, the headless Service and the ConfigMap are named after it)",
}
_DROP = {"title", "additionalProperties_false", "discriminator"}

Schema = dict[str, Any]


def _inline(node: Any, defs: dict[str, Schema]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs)
    return {key: _inline(value, defs) for key, value in node.items()}


def _structural(node: Schema) -> Schema:
    """Rewrite one (already inlined) pydantic schema node into a structural one."""
    node = dict(node)
    any_of = node.get("anyOf")
    if any_of is not None and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in any_of if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {any_of}")
        node.pop("anyOf")
        node = {**branches[0], **node}
    if node.get("default", "absent") is None:
        node.pop("default")
    for key in ("title", "discriminator"):
        node.pop(key, None)
    if node.get("additionalProperties") is False:
        node.pop("additionalProperties")
    if node.get("additionalProperties") is True:  # a model with extra="allow": keys pass as given
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "maxLength" in node and node.get("type") == "array":
        node["maxItems"] = node.pop("maxLength")
    if "maxLength" in node and node.get("type") == "object":
        node["maxProperties"] = node.pop("maxLength")
    if "properties" in node:
        node["type"] = "object"
        node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        required = node.get("required")
        if required is not None and not required:
            node.pop("required")
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = _structural(node["items"])
    return node


def model_schema(model: type[Any]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_inline(raw, defs))


def _add_rules(node: Schema, rules: list[dict[str, str]]) -> None:
    node.setdefault("x-kubernetes-validations", []).extend(rules)


IMAGE_RULE = {
    "rule": "has(self.image) || has(self.templateRef)",
    "message": "image is required unless templateRef names a template (whose image is used)",
    "fieldPath": ".image",
}


def _unless_templated(rule: dict[str, str]) -> dict[str, str]:
    """A spec-level rule the API server checks only on a job without a template: a template's
    fields are not in the stored job, so the operator checks the merged spec (Python twins)."""
    return {**rule, "rule": f"has(self.templateRef) || ({rule['rule']})"}


def spec_schema() -> Schema:
    spec = model_schema(TrainingJobSpec)
    spec["required"] = [f for f in spec["required"] if f != "image"]  # IMAGE_RULE says when
    _add_rules(spec, [IMAGE_RULE, *map(_unless_templated, CRD_SPEC_RULES), MANAGED_BY_RULE])
    _add_rules(spec["properties"]["parallelism"], CRD_PARALLELISM_RULES)
    return spec


def status_schema() -> Schema:
    status = model_schema(TrainingJobStatus)
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    status.pop("required", None)
    return status


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "TP", "type": "integer", "jsonPath": ".status.parallelism.tensor"},
    {"name": "PP", "type": "integer", "jsonPath": ".status.parallelism.pipeline"},
    {"name": "DP", "type": "integer", "jsonPath": ".status.parallelism.data"},
    {"name": "Pool", "type": "string", "jsonPath": ".status.pool"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.checkpoint.step",
     "description": "Latest committed checkpoint step"},
    {"name": "Progress", "type": "number", "jsonPath": ".status.progress.percentComplete",
     "description": "Percent of spec.training.steps done"},
    {"name": "ETA", "type": "string", "jsonPath": ".status.progress.eta",
     "description": "Time left at the recent rate of steps, as of the last heartbeat"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step", "priority": 1,
     "description": "Latest step reported by the trainer"},
    {"name": "Recovery", "type": "string", "jsonPath": ".status.recovery.timeToFirstStepSeconds",
     "description": "Seconds from the last failure to the new attempt's first training step"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason",
     "description": "Why the job is in its phase (see Message, or kubectl describe)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1,
     "description": "Why the job is in its phase, in words"},
]


def build_crd() -> dict[str, Any]:
    root = {
        "type": "object",
        "description": "A TrainingJob runs an elastic, topology-aware 3D-parallel training gang.",
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object (topotrain.io/v1alpha1)."},
            "kind": {"type": "string", "description": "Kind of this object (TrainingJob)."},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "required": ["spec"],
        "x-kubernetes-validations": [NAME_RULE],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "topotrain", "app.kubernetes.io/part-of": "topotrain"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["tj"],
                "categories": ["all", "topotrain"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.parallelism.data",
                            "statusReplicasPath": ".status.parallelism.data",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def render_crd() -> str:
    # The header names the models' file as it was before the package was laid out by layer
    # (now operator/topotrain/api/): kept, so the checked-in CRD stays byte for byte the same.
    header = "# Generated by `topotrain crd` from operator/topotrain/api.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
