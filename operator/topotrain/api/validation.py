"""What a TrainingJob must satisfy beyond its fields: the CRD's spec-level CEL rules, a whole
manifest's checks, and the spec's side of the data-degree rule.

Each CEL rule here has a Python twin (`spec.mesh_errors`, `spec_problems`), so offline
tools (`topotrain plan`, the tests) agree with the API server. `topotrain.degrees` decides
which data degrees run from plain numbers (the trainer shares it); `degree_rule`,
`limits_for` and `spec_problems` read those numbers off a spec.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from topotrain import GROUP, KIND, VERSION, degrees
from topotrain.api.spec import MAX_WORLD_SIZE, TrainingJobSpec
from topotrain.degrees import BatchRule, DataLimits, DegreeRule


def degree_rule(spec: TrainingJobSpec) -> DegreeRule:
    """The data-degree rule `spec` states."""
    par = spec.parallelism
    return DegreeRule(par.tensor, par.pipeline, spec.worker.gpus_per_pod, limits_for(spec))


def limits_for(spec: TrainingJobSpec) -> DataLimits:
    """The limits `spec` states (batch values that are not positive integers are ignored here;
    `spec_problems` reports them)."""
    par = spec.parallelism
    try:
        batch = BatchRule.from_training(spec.training, par.pipeline)
    except ValueError:
        batch = None
    return DataLimits(par.data_multiple or 1, tuple(par.allowed_data or ()), batch)


def spec_problems(spec: TrainingJobSpec) -> list[str]:
    """Each way `spec` asks for a data degree that can never run, naming the field; [] if none.

    For a spec stored before the rule (or one CEL cannot see, e.g. snake_case training keys):
    the reconciler reports these in `ConfigValid=False` (reason `degrees.REASON`) and planning
    still chooses only allowed degrees in [minData, data].
    """
    par = spec.parallelism
    try:
        BatchRule.from_training(spec.training, par.pipeline)
    except ValueError as exc:
        return [str(exc)]
    rule = degree_rule(spec)
    problems = []
    fields = [("data", par.data)] + ([("minData", par.min_data)] if par.min_data is not None else [])
    for name, value in fields:
        why = rule.problem(value)
        if why is not None:
            near = rule.nearest(value)
            hint = f"; nearest allowed: {', '.join(map(str, near))}" if near else ""
            problems.append(
                f"spec.parallelism.{name}={value} is not an allowed data degree: {why}{hint}"
            )
    return problems


CRD_SPEC_RULES = [
    {
        "rule": "(self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data)"
        " % self.worker.gpusPerPod == 0",
        "message": "worker.gpusPerPod must divide tensor*pipeline*data",
        "fieldPath": ".worker.gpusPerPod",
    },
    {
        "rule": "self.worker.gpusPerPod % self.parallelism.tensor == 0"
        " || self.parallelism.tensor % self.worker.gpusPerPod == 0",
        "message": "parallelism.tensor must divide worker.gpusPerPod or be a multiple of it",
        "fieldPath": ".parallelism.tensor",
    },
    *degrees.CRD_SPEC_RULES,
]
# A transition rule, checked whether or not the job names a template: managedBy may be neither
# added nor removed after creation (the field's own `self == oldSelf` covers a change).
MANAGED_BY_RULE = {
    "rule": "has(self.managedBy) == has(oldSelf.managedBy)",
    "message": "managedBy is immutable after creation",
    "fieldPath": ".managedBy",
}
CRD_PARALLELISM_RULES = [
    {
        "rule": f"self.tensor * self.pipeline * self.data <= {MAX_WORLD_SIZE}",
        "message": f"tensor*pipeline*data must be at most {MAX_WORLD_SIZE} ranks",
        "fieldPath": ".data",
    },
    {
        "rule": "!has(self.minData) || self.minData <= self.data",
        "message": "minData must be <= data (kubectl scale cannot go below minData)",
        "fieldPath": ".minData",
    },
    *degrees.CRD_PARALLELISM_RULES,
]


NAME_PATTERN = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 45


def validate_manifest(manifest: dict[str, Any]) -> list[str]:
    """Every problem of a TrainingJob manifest, each naming its field; [] when valid."""
    problems: list[str] = []
    if manifest.get("apiVersion") != f"{GROUP}/{VERSION}" or manifest.get("kind") != KIND:
        problems.append(f"apiVersion/kind: expected {GROUP}/{VERSION} {KIND}")
    name = str((manifest.get("metadata") or {}).get("name", ""))
    if len(name) > MAX_NAME or not NAME_PATTERN.match(name):
        problems.append(f"metadata.name: {name!r} must be a DNS-1035 label of at most {MAX_NAME} characters")
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        return [*problems, "spec: required"]
    if "templateRef" in spec and "image" not in spec:
        # Offline, the template is not at hand: the job is checked as if it set only the image.
        spec = {**spec, "image": "(the template's)"}
    try:
        parsed = TrainingJobSpec.model_validate(spec)
    except ValidationError as exc:
        for err in exc.errors():
            path = "spec" + "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in err["loc"]
            )
            problems.append(f"{path}: {err['msg']}")
        return problems
    model = parsed.training.get("model")
    if model is not None and model not in degrees.BUNDLED_MODELS:  # the CRD's enum
        problems.append(f"spec.training.model: Unsupported value {model!r}: supported values: "
                        f"{', '.join(degrees.BUNDLED_MODELS)}")  # fmt: skip
    # Checked here and in CEL, not in the model: a spec stored before the rule still parses,
    # so the operator can report it in a condition (spec_problems) instead of choking.
    return [*problems, *spec_problems(parsed)]
