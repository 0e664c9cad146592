"""The pod-template part of a TrainingJob: the worker, and what it passes through as given.

`WorkerSpec` says how each pod of the gang looks and where it may run: GPUs per pod,
pools, resources, tolerations, the security context, its environment (`EnvVar`: never a
variable of the operator->trainer contract), volumes, mounts and pod metadata.

Volumes and volume mounts are core/v1 objects taken as given; only the fields
the rules read are declared, every other key is kept (a free-form object with
a required name). The rules keep a job's additions clear of what the operator
owns: its own volumes and their mount points (contract.SHM_VOLUME and
CONTROL_VOLUME) and the labels and annotations it sets on pods (the
`topotrain.io/` prefix, `app.kubernetes.io/managed-by`). As in
`topotrain.api.spec`, each rule is CEL in the CRD and Python here.

It also holds what every API module builds on (`WireModel`, `cel`, `IMMUTABLE`, the
list limits): `topotrain.api.spec` imports this module, so they live here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from topotrain import GROUP
from topotrain.contract import CONTROL_DIR, CONTROL_VOLUME, RESERVED, SHM_DIR, SHM_VOLUME

RESERVED_VOLUMES = (SHM_VOLUME, CONTROL_VOLUME)
RESERVED_MOUNTS = (SHM_DIR, CONTROL_DIR)
OPERATOR_PREFIX = f"{GROUP}/"  # every label and annotation key the operator sets on pods but one
MANAGED_BY = "app.kubernetes.io/managed-by"  # that one (a label)
MAX_METADATA = 64  # labels, or annotations, a job adds to each pod
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # what the API server requires of a volume name
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


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


# --- the worker: how each pod of the gang looks and where it may run -----------------------

Quantity = Annotated[
    int | str,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]

IMMUTABLE = [{"rule": "self == oldSelf", "message": "is immutable after creation"}]
MAX_ENV = 128
MAX_LIST = 64


class EnvVar(WireModel):
    """An environment variable for the trainer container."""

    name: str = Field(..., min_length=1, max_length=256, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: FreeForm | None = Field(
        None, alias="valueFrom", description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."
    )


_RESERVED_LIST = ", ".join(f"'{name}'" for name in sorted(RESERVED))
ENV_RULE = {
    "rule": f"self.all(e, !(e.name in [{_RESERVED_LIST}]))",
    "message": "must not set a variable of the operator->trainer contract (TOPOTRAIN_*, MASTER_*, "
    "NNODES, NODE_RANK, NPROC_PER_NODE, WORLD_SIZE); the operator sets those",
}


def _no_reserved(env: list[EnvVar]) -> list[EnvVar]:
    clashes = sorted({e.name for e in env} & RESERVED)
    if clashes:
        raise ValueError(f"{ENV_RULE['message']}: {', '.join(clashes)}")
    return env


EnvList = Annotated[list[EnvVar], AfterValidator(_no_reserved)]


class Toleration(WireModel):
    """A core/v1 Toleration."""

    key: str | None = Field(None, description="Taint key the toleration applies to; empty matches all keys.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal (default Equal).")
    value: str | None = Field(None, description="Taint value the toleration matches (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        None, alias="tolerationSeconds", description="How long a NoExecute taint is tolerated."
    )


class Resources(WireModel):
    """Extra container resources. The operator adds `nvidia.com/gpu: gpusPerPod` itself."""

    requests: dict[str, Quantity] | None = Field(None, description="Resource requests, e.g. cpu, memory.")
    limits: dict[str, Quantity] | None = Field(None, description="Resource limits.")


PodSecurity = Literal["Restricted", "Unrestricted"]
TRAINER_UID = 10001  # the bundled trainer image's user (trainer_image/Dockerfile)
SECURITY_CONTEXT_RULE = {
    "rule": "!has(self.securityContext) || self.podSecurity == 'Unrestricted'",
    "message": "securityContext requires podSecurity: Unrestricted (Restricted pods get the "
    "operator's restricted securityContext)",
    "fieldPath": ".securityContext",
}


class WorkerSpec(WireModel):
    """How each pod of the gang looks and where it may run."""

    model_config = ConfigDict(json_schema_extra=cel(SECURITY_CONTEXT_RULE, MOUNT_VOLUME_RULE))

    gpus_per_pod: int = Field(
        8, alias="gpusPerPod", ge=1, le=64,
        description="GPUs (ranks) per pod; pods = tensor*pipeline*data / gpusPerPod. Immutable.",
        json_schema_extra=cel(*IMMUTABLE),
    )
    gpu_types: list[str] = Field(
        default_factory=list, alias="gpuTypes", max_length=MAX_LIST,
        description="Acceptable GPU pools (values of the node label nvidia.com/gpu.product), in "
        "preference order. Empty: any pool.",
        json_schema_extra={"default": []},
    )
    resources: Resources | None = Field(None, description="Extra container resources (cpu, memory, ...).")
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=MAX_LIST, description="Tolerations added to every pod.",
        json_schema_extra={"default": []},
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, alias="nodeSelector", description="Nodes must carry these labels.",
        json_schema_extra={"default": {}},
    )
    service_account_name: str | None = Field(
        None, alias="serviceAccountName", description="ServiceAccount the training pods run as."
    )
    priority_class_name: str | None = Field(
        None, alias="priorityClassName", description="PriorityClass of the training pods."
    )
    pod_security: PodSecurity = Field(
        "Restricted", alias="podSecurity",
        description="Restricted (default): the pods pass the `restricted` Pod Security Standard: "
        "they run as runAsUser (never root), without privilege escalation, with every capability "
        "dropped and the RuntimeDefault seccomp profile. Unrestricted: the operator sets no "
        "securityContext but worker.securityContext, so the image's own user (root included) "
        "applies; for images that need root or extra capabilities.",
    )
    run_as_user: int = Field(
        TRAINER_UID, alias="runAsUser", ge=1, le=2147483647,
        description="UID and GID the trainer runs as under podSecurity Restricted. Default 10001, "
        "the bundled trainer image's user.",
    )
    security_context: FreeForm | None = Field(
        None, alias="securityContext",
        description="A core/v1 container SecurityContext used as given under podSecurity "
        "Unrestricted (for example capabilities.add [IPC_LOCK] for RDMA). Rejected under Restricted.",
    )
    automount_service_account_token: bool = Field(
        False, alias="automountServiceAccountToken",
        description="Mount the ServiceAccount's API token into the pods. Default false: the "
        "bundled trainer never calls the Kubernetes API.",
    )
    shm_size: Quantity | None = Field(
        None, alias="shmSize",
        description="Size limit of /dev/shm, a memory-backed emptyDir counted against the pod's "
        "memory. Default: no limit of its own (bounded by the pod's memory limit).",
    )
    env: EnvList = Field(
        default_factory=list, max_length=MAX_ENV, description="Environment added to the trainer container.",
        json_schema_extra={"default": [], **cel(ENV_RULE)},
    )
    # The pass-through fields below default to None, not []: a job that sets none of them keeps
    # its template_hash across an operator upgrade, so its gang does not roll.
    volumes: list[Volume] | None = Field(
        None, max_length=MAX_LIST,
        description="core/v1 Volumes added to every pod after the operator's own (dshm at "
        "/dev/shm, topotrain-control at /etc/topotrain). Names are unique.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    volume_mounts: list[VolumeMount] | None = Field(
        None, alias="volumeMounts", max_length=MAX_LIST,
        description="core/v1 VolumeMounts added to the trainer container, each of a volume of "
        "worker.volumes. Mount paths are unique.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]},
    )
    image_pull_secrets: list[Annotated[str, Field(min_length=1, max_length=253)]] | None = Field(
        None, alias="imagePullSecrets", max_length=MAX_LIST,
        description="Names of Secrets in the job's namespace to pull the image with.",
    )
    labels: PodLabels | None = Field(
        None, max_length=MAX_METADATA,
        description="Labels added to every pod; not topotrain.io/ keys or "
        "app.kubernetes.io/managed-by (the operator's).",
        json_schema_extra=cel(LABELS_RULE),
    )
    annotations: PodAnnotations | None = Field(
        None, max_length=MAX_METADATA,
        description="Annotations added to every pod; not topotrain.io/ keys (the operator's).",
        json_schema_extra=cel(ANNOTATIONS_RULE),
    )

    @model_validator(mode="after")
    def _security_context_needs_unrestricted(self) -> WorkerSpec:
        if self.security_context is not None and self.pod_security != "Unrestricted":
            raise ValueError(
                "spec.worker.securityContext requires spec.worker.podSecurity: Unrestricted "
                f"(it is {self.pod_security})"
            )
        return self

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> WorkerSpec:
        problems = volume_problems(self.volumes or [], self.volume_mounts or [])
        if problems:
            raise ValueError("; ".join(problems))
        return self
