"""The parts of the pod template a TrainingJob passes through: volumes, mounts, pod metadata.

Volumes and volume mounts are core/v1 objects taken as given; only the fields
the rules read are declared, every other key is kept (a free-form object with
a required name). The rules keep a job's additions clear of what the operator
owns: its own volumes and their mount points (contract.SHM_VOLUME and
CONTROL_VOLUME) and the labels and annotations it sets on pods (the
`topotrain.io/` prefix, `app.kubernetes.io/managed-by`). As in
`topotrain.api`, each rule is CEL in the CRD and Python here.

It also holds what both API modules build on (`WireModel`, `cel`): `topotrain.api`
imports this module, so they live here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from topotrain import GROUP
from topotrain.contract import CONTROL_DIR, CONTROL_VOLUME, SHM_DIR, SHM_VOLUME

RESERVED_VOLUMES = (SHM_VOLUME, CONTROL_VOLUME)
RESERVED_MOUNTS = (SHM_DIR, CONTROL_DIR)
OPERATOR_PREFIX = f"{GROUP}/"  # every label and annotation key the operator sets on pods but one
MANAGED_BY = "app.kubernetes.io/managed-by"  # that one (a label)
MAX_METADATA = 64  # labels, or annotations, a job adds to each pod
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # what the API server requires of a volume name


def _quoted(values: Iterable[str]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def cel(*rules: dict[str, str]) -> dict[str, Any]:
    """A schema extra carrying CEL rules (x-kubernetes-validations)."""
    return {"x-kubernetes-validations": list(rules)}


class WireModel(BaseModel):
    """An API object with camelCase wire names; unknown keys are refused."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=False)

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict as stored in the API server (None fields dropped)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


VOLUME_NAME_RULE = {
    "rule": f"!(self in [{_quoted(RESERVED_VOLUMES)}])",
    "message": f"must not be {' or '.join(RESERVED_VOLUMES)}: the operator's own volumes have "
    "those names",
}
MOUNT_PATH_RULE = {
    "rule": " && ".join(f"self != '{path}' && !self.startsWith('{path}/')" for path in RESERVED_MOUNTS),
    "message": f"must not be {' or '.join(RESERVED_MOUNTS)} or below them: the operator mounts its "
    "own volumes there",
}
MOUNT_VOLUME_RULE = {
    "rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes)"
    " && self.volumes.exists(v, v.name == m.name))",
    "message": "each volumeMount must name a volume of worker.volumes",
    "fieldPath": ".volumeMounts",
}
LABELS_RULE = {
    "rule": f"self.all(k, !k.startsWith('{OPERATOR_PREFIX}') && k != '{MANAGED_BY}')",
    "message": f"must not set a label the operator sets ({OPERATOR_PREFIX} keys, {MANAGED_BY})",
}
ANNOTATIONS_RULE = {
    "rule": f"self.all(k, !k.startsWith('{OPERATOR_PREFIX}'))",
    "message": f"must not set an annotation the operator sets ({OPERATOR_PREFIX} keys)",
}


def reserved_mount(path: str) -> str | None:
    """The operator's mount point that `path` is, or lies below; None when clear of them."""
    return next((own for own in RESERVED_MOUNTS if path == own or path.startswith(f"{own}/")), None)


def _not_reserved_volume(name: str) -> str:
    if name in RESERVED_VOLUMES:
        raise ValueError(f"{VOLUME_NAME_RULE['message']} ({name!r})")
    return name


def _not_reserved_mount(path: str) -> str:
    if reserved_mount(path) is not None:
        raise ValueError(f"{MOUNT_PATH_RULE['message']} ({path!r})")
    return path


def operator_label(key: str) -> bool:
    return key.startswith(OPERATOR_PREFIX) or key == MANAGED_BY


def operator_annotation(key: str) -> bool:
    return key.startswith(OPERATOR_PREFIX)


def _refuse(values: dict[str, str], owned: Callable[[str], bool], rule: dict[str, str]) -> dict[str, str]:
    clashes = sorted(key for key in values if owned(key))
    if clashes:
        raise ValueError(f"{rule['message']}: {', '.join(clashes)}")
    return values


def _no_operator_labels(labels: dict[str, str]) -> dict[str, str]:
    return _refuse(labels, operator_label, LABELS_RULE)


def _no_operator_annotations(annotations: dict[str, str]) -> dict[str, str]:
    return _refuse(annotations, operator_annotation, ANNOTATIONS_RULE)


PodLabels = Annotated[dict[str, str], AfterValidator(_no_operator_labels)]
PodAnnotations = Annotated[dict[str, str], AfterValidator(_no_operator_annotations)]


class _PassThrough(WireModel):
    """A core/v1 object kept whole: undeclared keys pass as given."""

    model_config = ConfigDict(extra="allow")


class Volume(_PassThrough):
    """A core/v1 Volume (persistentVolumeClaim, configMap, secret, csi, ...) added to every pod."""

    name: Annotated[str, AfterValidator(_not_reserved_volume)] = Field(
        ..., min_length=1, max_length=63, pattern=DNS_LABEL,
        description=f"Volume name, unique in the pod; {' and '.join(RESERVED_VOLUMES)} are the "
        "operator's.",
        json_schema_extra=cel(VOLUME_NAME_RULE),
    )


class VolumeMount(_PassThrough):
    """A core/v1 VolumeMount (readOnly, subPath, ... pass as given) of the trainer container."""

    name: str = Field(..., min_length=1, max_length=63, description="A volume of worker.volumes.")
    mount_path: Annotated[str, AfterValidator(_not_reserved_mount)] = Field(
        ..., alias="mountPath", min_length=1, max_length=4096,
        description=f"Where it appears in the container; not {' or '.join(RESERVED_MOUNTS)} or "
        "below them (the operator's mounts).",
        json_schema_extra=cel(MOUNT_PATH_RULE),
    )


def volume_problems(volumes: list[Volume], mounts: list[VolumeMount]) -> list[str]:
    """Duplicate volume names and mount paths, mounts of volumes the spec lacks: each names its
    field (the CRD's list-map keys and MOUNT_VOLUME_RULE say the same)."""
    problems = []
    names: dict[str, int] = {}
    for i, volume in enumerate(volumes):
        if volume.name in names:
            problems.append(f"spec.worker.volumes[{i}].name: Duplicate value {volume.name!r} "
                            f"(spec.worker.volumes[{names[volume.name]}] has it)")
        names.setdefault(volume.name, i)
    paths: dict[str, int] = {}
    for i, mount in enumerate(mounts):
        if mount.name not in names:
            problems.append(f"spec.worker.volumeMounts[{i}].name: {mount.name!r} is not in "
                            f"spec.worker.volumes ({MOUNT_VOLUME_RULE['message']})")
        if mount.mount_path in paths:
            problems.append(f"spec.worker.volumeMounts[{i}].mountPath: Duplicate value "
                            f"{mount.mount_path!r} (spec.worker.volumeMounts[{paths[mount.mount_path]}] "
                            "has it)")
        paths.setdefault(mount.mount_path, i)
    return problems
