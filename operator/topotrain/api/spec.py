"""The TrainingJob API (topotrain.io/v1alpha1) as pydantic models.

These models are the single source of truth: `topotrain crd` generates the
CRD's OpenAPI schema from them, and every rule the API server can check is
also enforced here (as CEL in the CRD, as validators in Python; the
allowed-data-degree rule of `topotrain.degrees` in `validate_manifest`), so a
spec that passes one passes the other. Aliases are the camelCase wire names.
The parts of the pod template passed through as given (volumes, mounts, pod
labels and annotations) and their rules live in `topotrain.api_pod`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from topotrain import GROUP, KIND, VERSION, degrees
from topotrain.api.pod import (
    ANNOTATIONS_RULE,
    LABELS_RULE,
    MAX_METADATA,
    MOUNT_VOLUME_RULE,
    PodAnnotations,
    PodLabels,
    Volume,
    VolumeMount,
    WireModel,
    cel,
    volume_problems,
)
from topotrain.api.status import TrainingJobStatus
from topotrain.contract import DEFAULT_METRICS_PORT, RANK_ORDERS, RESERVED

RankOrder = Literal["tp-pp-dp", "tp-dp-pp"]
Requirement = Literal["Required", "Preferred"]
assert set(RANK_ORDERS) == {"tp-pp-dp", "tp-dp-pp"}

Quantity = Annotated[
    int | str,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]

TRAINING_SCHEMA: dict[str, Any] = {
    "type": "object", "x-kubernetes-preserve-unknown-fields": True,
    # Declared so that CEL can read them (degrees.CRD_SPEC_RULES); other keys pass through.
    "properties": {
        "globalBatch": {"type": "integer", "minimum": 1, "description": "Bundled trainer: samples "
                        f"per optimizer step (default {degrees.DEFAULT_GLOBAL_BATCH}). Setting it "
                        "(or microBatch) makes the operator apply the batch rule to data degrees."},
        "microBatch": {"type": "integer", "minimum": 1, "description": "Bundled trainer: samples per "
                       f"forward/backward on one rank (default {degrees.DEFAULT_MICRO_BATCH})."},
        "schedule": {"type": "string", "description": "Bundled trainer: pipeline schedule, 1f1b "
                     f"or gpipe (default {degrees.DEFAULT_SCHEDULE})."},
        "metricsPort": {"type": "integer", "minimum": 0, "maximum": 65535, "description":
                        "Bundled trainer: Prometheus port of local rank 0 in each pod (default "
                        f"{DEFAULT_METRICS_PORT}; 0 disables). Declared as the pods' `metrics` port "
                        "and opened to every source by the job's NetworkPolicy."},
    },
}
TrainingFreeForm = Annotated[dict[str, Any], WithJsonSchema(TRAINING_SCHEMA)]

IMMUTABLE = [{"rule": "self == oldSelf", "message": "is immutable after creation"}]
MAX_ENV = 128
MAX_LIST = 64


class Parallelism(WireModel):
    """Degrees of the 3D mesh; tensor*pipeline*data GPUs in all."""

    tensor: int = Field(
        1, ge=1, le=1024, description="Tensor-parallel degree (TP). Immutable.",
        json_schema_extra=cel(*IMMUTABLE),
    )
    pipeline: int = Field(
        1, ge=1, le=1024, description="Pipeline-parallel degree (PP): number of stages. Immutable.",
        json_schema_extra=cel(*IMMUTABLE),
    )
    data: int = Field(
        ..., ge=1, le=65536,
        description="Desired data-parallel degree (DP). The scale subresource points here: "
        "`kubectl scale tj/NAME --replicas=N` sets it.",
    )
    min_data: int | None = Field(
        None, alias="minData", ge=1, le=65536,
        description="Elastic lower bound of the data degree: when capacity is lost the job "
        "shrinks down to this instead of waiting. Default: equal to data (not elastic).",
    )
    data_multiple: int | None = Field(
        None, alias="dataMultiple", ge=1, le=65536,
        description="For a trainer of your own: every data degree the job runs at (data, minData "
        "and each elastic shrink or grow) is a multiple of this. Default 1.",
    )
    allowed_data: list[Annotated[int, Field(ge=1, le=65536)]] | None = Field(
        None, alias="allowedData", max_length=MAX_LIST,
        description="For a trainer of your own: the only data degrees the job may run at "
        "(data and minData must be in it). Default: any degree the other rules allow.",
    )

    @model_validator(mode="after")
    def _min_le_data(self) -> Parallelism:
        if self.min_data is not None and self.min_data > self.data:
            raise ValueError(
                f"spec.parallelism.minData ({self.min_data}) must be <= spec.parallelism.data ({self.data})"
            )
        return self

    @property
    def effective_min_data(self) -> int:
        return self.data if self.min_data is None else self.min_data

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data


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


class TopologySpec(WireModel):
    """Placement constraints per parallel dimension: Required (hard) or Preferred (scored)."""

    tensor: Requirement = Field(
        "Required", description="Required: a tensor-parallel group never leaves one NVLink domain."
    )
    pipeline: Requirement = Field(
        "Preferred", description="Required: a pipeline (all stages of one replica) stays inside one rack."
    )
    data: Requirement = Field(
        "Preferred", description="Required: a data-parallel group stays inside one rack."
    )


class CheckpointSpec(WireModel):
    """Where the trainer writes asynchronous sharded checkpoints and the operator finds them."""

    uri: str = Field(
        ..., min_length=6, max_length=1024,
        description="s3://bucket/prefix; the job's data lives under <uri>/<namespace>/<name>/.",
        json_schema_extra=cel({"rule": "self.startsWith('s3://')", "message": "must start with s3:// (s3://bucket/prefix)"}),
    )
    endpoint: str | None = Field(
        None, max_length=1024,
        description="S3-compatible endpoint URL (MinIO, SeaweedFS, versitygw, ...). Default: the "
        "operator's configured endpoint, else AWS.",
    )
    credentials_secret: str | None = Field(
        None, alias="credentialsSecret", max_length=253,
        description="Secret in the job's namespace with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.",
    )
    interval_steps: int = Field(200, alias="intervalSteps", ge=1, description="Checkpoint every N steps.")
    keep: int = Field(3, ge=1, le=1000, description="Committed checkpoints to retain.")
    resume_policy: Literal["IfOwned", "Always"] = Field(
        "IfOwned", alias="resumePolicy",
        description="IfOwned (default): the job resumes only checkpoints it wrote itself; if its "
        "prefix already holds committed checkpoints of another run (say, a deleted job of the same "
        "name), it does not start and condition ConfigValid says so. Always: it starts from them, "
        "and status.resumedFrom names the run they came from.",
    )

    @model_validator(mode="after")
    def _s3_uri(self) -> CheckpointSpec:
        if not self.uri.startswith("s3://"):
            raise ValueError(f"spec.checkpoint.uri {self.uri!r} must start with s3:// (s3://bucket/prefix)")
        return self


class FailurePolicy(WireModel):
    """How failures are retried."""

    max_restarts: int = Field(
        20, alias="maxRestarts", ge=0,
        description="Restarts after application failures (a non-zero exit, a hang) before the job "
        "is Failed.",
    )
    max_infrastructure_restarts: int = Field(
        100, alias="maxInfrastructureRestarts", ge=0,
        description="Restarts after infrastructure failures (node lost or NotReady, eviction, "
        "preemption, pod deleted, pods that never start) before the job is Failed; a budget of "
        "its own, so a flaky cluster does not use up maxRestarts.",
    )
    scheduling_timeout_seconds: int = Field(
        600, alias="schedulingTimeoutSeconds", ge=0,
        description="Pods released but not Running after this long (image pull errors, "
        "CreateContainerConfigError, Unschedulable) restart the gang away from their nodes "
        "(an infrastructure failure); pods the API server keeps refusing fail the job after this "
        "long. 0 disables.",
    )
    node_failure_threshold: int = Field(
        2, alias="nodeFailureThreshold", ge=0,
        description="A node that failed this job's pods this many times is avoided by its "
        "re-plans (status.nodeFailures). 0 never avoids a node.",
    )
    backoff_seconds: int = Field(
        10, alias="backoffSeconds", ge=0,
        description="Delay before the first restart; doubles per restart, capped at maxBackoffSeconds.",
    )
    max_backoff_seconds: int = Field(
        300, alias="maxBackoffSeconds", ge=0, description="Cap of the exponential restart backoff."
    )
    progress_timeout_seconds: int = Field(
        600, alias="progressTimeoutSeconds", ge=0,
        description="Hang detection: restart when progress.json is older than this while Running. 0 disables.",
    )
    startup_timeout_seconds: int = Field(
        1800, alias="startupTimeoutSeconds", ge=0,
        description="Hang detection before an attempt's first heartbeat: restart when the gang has been "
        "Running this long and its trainer has not yet written progress.json (imports, rendezvous, "
        "checkpoint load). 0 uses progressTimeoutSeconds.",
    )
    restart_in_place: bool = Field(
        True, alias="restartInPlace",
        description="After a trainer crash, a hang or one lost pod, keep the gang's healthy pods "
        "and restart their trainer processes in place (the bundled trainer's supervisor), "
        "replacing only the failed pod; false always recreates the whole gang.",
    )
    non_retryable_exit_codes: list[int] = Field(
        default_factory=lambda: [78], alias="nonRetryableExitCodes", max_length=MAX_LIST,
        description="Trainer exit codes that fail the job at once (bad configuration). "
        "78 (EX_CONFIG) is what the bundled trainer uses for an invalid config.",
        json_schema_extra={"default": [78]},
    )


class TrainingJobSpec(WireModel):
    """Desired state of a TrainingJob."""

    image: str = Field(..., min_length=1, max_length=1024, description="Trainer container image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, alias="imagePullPolicy", description="Image pull policy of the trainer container."
    )
    command: list[str] | None = Field(
        None, max_length=MAX_LIST, description="Container command. Default: the image's entrypoint."
    )
    args: list[str] | None = Field(None, max_length=MAX_LIST, description="Container arguments.")
    env: EnvList = Field(
        default_factory=list, max_length=MAX_ENV,
        description="Environment for the trainer container (worker.env is applied after it).",
        json_schema_extra={"default": [], **cel(ENV_RULE)},
    )
    parallelism: Parallelism = Field(..., description="Tensor x pipeline x data degrees.")
    rank_order: RankOrder = Field(
        "tp-pp-dp", alias="rankOrder",
        description="Mesh dimensions innermost to outermost: tp-pp-dp (r = (dp*PP + pp)*TP + tp) "
        "or tp-dp-pp (Megatron). Immutable.",
        json_schema_extra=cel(*IMMUTABLE),
    )
    worker: WorkerSpec = Field(
        default_factory=lambda: WorkerSpec(), description="Pod template and pools.",
        json_schema_extra={"default": {}},
    )
    topology: TopologySpec = Field(
        default_factory=lambda: TopologySpec(), description="Topology constraints per dimension.",
        json_schema_extra={"default": {}},
    )
    checkpoint: CheckpointSpec | None = Field(None, description="Asynchronous checkpoints in S3.")
    failure_policy: FailurePolicy = Field(
        default_factory=lambda: FailurePolicy(), alias="failurePolicy", description="Restart policy.",
        json_schema_extra={"default": {}},
    )
    training: TrainingFreeForm = Field(
        default_factory=dict, description="Free-form configuration handed to the trainer as JSON "
        "(TOPOTRAIN_TRAINING_CONFIG).", json_schema_extra={"default": {}},
    )
    suspend: bool = Field(
        False, description="true stops the gang and keeps the job: a running gang is asked for a "
        "checkpoint of its current step first (bounded; then the last commit), then its pods are "
        "deleted and the phase is Suspended. false again resumes it from the newest committed step "
        "as a new attempt. Neither uses a restart budget.",
    )

    @property
    def pods(self) -> int:
        return self.parallelism.world_size // self.worker.gpus_per_pod

    @property
    def metrics_port(self) -> int | None:
        """The bundled trainer's Prometheus port in each pod (spec.training.metricsPort), or None
        when it serves none (0)."""
        port = self.training.get("metricsPort", DEFAULT_METRICS_PORT)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            return None
        return port

    @model_validator(mode="after")
    def _mesh_fits_pods(self) -> TrainingJobSpec:
        for message in mesh_errors(self.parallelism, self.worker.gpus_per_pod):
            raise ValueError(message)
        return self


# Ranks in one gang (8192 pods of 8 GPUs). Planning time and the rank table grow with the
# world size; the cap keeps one reconcile pass short and the rank table under 1 MiB.
MAX_WORLD_SIZE = 65536


def mesh_errors(par: Parallelism, gpus_per_pod: int) -> list[str]:
    """The spec-level rules, in Python; CRD_SPEC_RULES says the same in CEL."""
    errors = []
    if par.world_size % gpus_per_pod:
        errors.append(
            f"spec.worker.gpusPerPod ({gpus_per_pod}) must divide tensor*pipeline*data ({par.world_size})"
        )
    if gpus_per_pod % par.tensor and par.tensor % gpus_per_pod:
        errors.append(
            f"spec.parallelism.tensor ({par.tensor}) must divide spec.worker.gpusPerPod "
            f"({gpus_per_pod}) or be a multiple of it"
        )
    if par.world_size > MAX_WORLD_SIZE:
        errors.append(
            f"spec.parallelism.data: tensor*pipeline*data ({par.world_size}) must be at most "
            f"{MAX_WORLD_SIZE} ranks"
        )
    return errors


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


class ObjectMeta(WireModel):
    """The subset of metadata the operator reads."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    name: str = Field(..., description="Job name.")
    namespace: str = Field("default", description="Job namespace.")
    uid: str | None = Field(None, description="Object UID.")
    generation: int | None = Field(None, description="Spec generation.")


class TrainingJob(WireModel):
    """A TrainingJob object as stored in the API server."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    api_version: str = Field(f"{GROUP}/{VERSION}", alias="apiVersion", description="topotrain.io/v1alpha1")
    kind: str = Field(KIND, description="TrainingJob")
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: TrainingJobStatus = Field(default_factory=lambda: TrainingJobStatus())


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
    try:
        parsed = TrainingJobSpec.model_validate(spec)
    except ValidationError as exc:
        for err in exc.errors():
            path = "spec" + "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in err["loc"]
            )
            problems.append(f"{path}: {err['msg']}")
        return problems
    # Checked here and in CEL, not in the model: a spec stored before the rule still parses,
    # so the operator can report it in a condition (degrees.spec_problems) instead of choking.
    return [*problems, *degrees.spec_problems(parsed)]
