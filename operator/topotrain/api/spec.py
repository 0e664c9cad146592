"""The TrainingJob API (topotrain.io/v1alpha1) as pydantic models.

These models are the single source of truth: `topotrain crd` generates the
CRD's OpenAPI schema from them, and every rule the API server can check is
also enforced here (as CEL in the CRD, as validators in Python; the spec-level
rules and the allowed-data-degree rule of `topotrain.degrees` in
`topotrain.api.validation`), so a spec that passes one passes the other.
Aliases are the camelCase wire names. The worker (the pod template: volumes,
mounts, pod labels and annotations passed through as given) and its rules live
in `topotrain.api.pod`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from topotrain import GROUP, KIND, VERSION, degrees
from topotrain.api.failure_rules import MAX_RULES, UNIQUE_NAMES_RULE, FailureRule, unique_names
from topotrain.api.pod import (
    DNS_SUBDOMAIN,
    ENV_RULE,
    IMMUTABLE,
    MAX_ENV,
    MAX_LIST,
    EnvList,
    WireModel,
    WorkerSpec,
    cel,
)
from topotrain.api.status import TrainingJobStatus
from topotrain.contract import DEFAULT_METRICS_PORT, RANK_ORDERS

RankOrder = Literal["tp-pp-dp", "tp-dp-pp"]
Requirement = Literal["Required", "Preferred"]
assert set(RANK_ORDERS) == {"tp-pp-dp", "tp-dp-pp"}

TRAINING_SCHEMA: dict[str, Any] = {
    "type": "object", "x-kubernetes-preserve-unknown-fields": True,
    # Declared so that CEL can read them (degrees.CRD_SPEC_RULES); other keys pass through.
    "properties": {
        "globalBatch": {"type": "integer", "minimum": 1, "description": "Bundled trainer: samples "
                        f"per optimizer step (default {degrees.DEFAULT_GLOBAL_BATCH}). Setting it "
                        "(or microBatch) makes the operator apply the batch rule to data degrees."},
        "microBatch": {"type": "integer", "minimum": 1, "description": "Bundled trainer: samples per "
                       f"forward/backward on one rank (default {degrees.DEFAULT_MICRO_BATCH})."},
        "model": {"type": "string", "enum": list(degrees.BUNDLED_MODELS), "description": "Bundled "
                  "trainer: the model to train (default tiny): tiny and small for tests and CPUs; "
                  "1B, 3B, 8B and 70B the Llama 3 shapes; 7B and 13B the Llama 2 shapes. Reserved "
                  "for the bundled trainer (a trainer of your own names its model another way)."},
        "schedule": {"type": "string", "description": "Bundled trainer: pipeline schedule, 1f1b "
                     f"or gpipe (default {degrees.DEFAULT_SCHEDULE})."},
        "metricsPort": {"type": "integer", "minimum": 0, "maximum": 65535, "description":
                        "Bundled trainer: Prometheus port of local rank 0 in each pod (default "
                        f"{DEFAULT_METRICS_PORT}; 0 disables). Declared as the pods' `metrics` port "
                        "and opened to every source by the job's NetworkPolicy."},
    },
}
TrainingFreeForm = Annotated[dict[str, Any], WithJsonSchema(TRAINING_SCHEMA)]


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
    rules: list[FailureRule] = Field(
        default_factory=list, max_length=MAX_RULES,
        description="Failure rules, in order; the first that matches a failure decides what is "
        "done (Fail, Restart, RestartWithoutCounting); a failure no rule matches follows the "
        "built-in policy (docs/api.md, Failure rules).",
        json_schema_extra={"default": [], **cel(UNIQUE_NAMES_RULE)},
    )

    _unique_rules = field_validator("rules")(unique_names)


class TemplateRef(WireModel):
    """The TrainingJobTemplate a job starts from (docs/api.md, Templates)."""

    name: str = Field(
        ..., min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
        description="Name of a (cluster-scoped) TrainingJobTemplate. The job's own fields win, "
        "field by field; a list the job sets replaces the template's whole list.",
    )
    follow_updates: bool = Field(
        False, alias="followUpdates",
        description="false (default): the job keeps the template's generation it first resolved "
        "(status.jobTemplate), whatever edits follow. true: it takes each new generation, and a "
        "changed pod template rolls the gang as a spec edit does.",
    )


class TrainingJobSpec(WireModel):
    """Desired state of a TrainingJob."""

    template_ref: TemplateRef | None = Field(
        None, alias="templateRef",
        description="Start from this TrainingJobTemplate: the platform's image, worker, "
        "topology, checkpoint and failure-policy settings; this spec's own fields win.",
    )
    image: str = Field(
        ..., min_length=1, max_length=1024,
        description="Trainer container image (may come from spec.templateRef's template).",
    )
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
    active_deadline_seconds: int | None = Field(
        None, alias="activeDeadlineSeconds", ge=1,
        description="Seconds the job may run, from status.startTime (its first attempt); then "
        "a running gang is asked for a final checkpoint (bounded, as for spec.suspend) and the "
        "job is Failed with reason DeadlineExceeded. Time suspended counts.",
    )
    ttl_seconds_after_finished: int | None = Field(
        None, alias="ttlSecondsAfterFinished", ge=0,
        description="Seconds after the job Succeeded or Failed (status.completionTime) when the "
        "operator deletes it, and with it its pods, Service and rank table; its checkpoints in "
        "the store are kept. Default: the job is kept.",
    )
    suspend: bool = Field(
        False, description="true stops the gang and keeps the job: a running gang is asked for a "
        "checkpoint of its current step first (bounded; then the last commit), then its pods are "
        "deleted and the phase is Suspended. false again resumes it from the newest committed step "
        "as a new attempt. Neither uses a restart budget.",
    )
    managed_by: str | None = Field(
        None, alias="managedBy", min_length=1, max_length=63,
        description="The controller that runs this job. Unset or topotrain.io/trainingjob-controller: "
        "topotrain. kueue.x-k8s.io/multikueue: Kueue's MultiKueue dispatches it to a worker cluster "
        "(topotrain here only creates its Workload; docs/multicluster.md). Any other value: another "
        "controller, and topotrain creates no pods and writes no status for it. Immutable.",
        json_schema_extra=cel(*IMMUTABLE),
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
    """The spec-level rules, in Python; validation.CRD_SPEC_RULES says the same in CEL."""
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
