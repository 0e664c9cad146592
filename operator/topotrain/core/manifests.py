"""Pure builders of a TrainingJob's children: headless Service, rank-table ConfigMap, Pods.

Naming (documented in docs/operator.md):

- Service `<job>` (headless, publishes not-ready addresses so rendezvous
  starts before readiness), selecting every pod of the job.
- Pod `<job>-<attempt>-<index>`, hostname the same, subdomain `<job>`, so
  `MASTER_ADDR=<job>-<attempt>-0.<job>.<namespace>.svc` names pod 0 of the
  current attempt and never an older pod that is still terminating.
- ConfigMap `<job>-ranks`: the rank table of the current attempt (rank_table.py).
- NetworkPolicy `<job>` (when the operator's setting asks): ingress to the
  job's pods only from the job's pods.

Every child carries `topotrain.io/job`, `app.kubernetes.io/managed-by` and a
controller owner reference, so deleting the job garbage-collects them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from topotrain import GROUP, KIND, VERSION
from topotrain.api.pod import MANAGED_BY, WorkerSpec
from topotrain.api.spec import TrainingJobSpec
from topotrain.checkpoints import job_prefix
from topotrain.contract import (
    ACCESS_KEY_ID,
    ATTEMPT_ANNOTATION,
    CONTROL_DIR,
    CONTROL_FILE,
    CONTROL_VOLUME,
    MASTER_ADDR_ANNOTATION,
    RESUME_STEP_ANNOTATION,
    S3_ENDPOINT,
    SECRET_ACCESS_KEY,
    SHM_DIR,
    SHM_VOLUME,
    TrainerEnv,
)

JOB_LABEL = "topotrain.io/job"
ATTEMPT_LABEL = "topotrain.io/attempt"
INDEX_LABEL = "topotrain.io/index"
NODE_ANNOTATION = "topotrain.io/node"
RESUME_ANNOTATION = RESUME_STEP_ANNOTATION
TEMPLATE_ANNOTATION = "topotrain.io/template"  # hash of the spec fields the pods are built from
GANG_GATE = "topotrain.io/gang"
FIELD_OWNER = "topotrain"
GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER = "trainer"


@dataclass(frozen=True)
class JobMeta:
    """The parts of the TrainingJob's metadata its children refer to."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class PodPlan:
    """One pod of one attempt."""

    attempt: int
    index: int
    node: str
    data: int
    resume_step: int | None
    master_port: int = 29500
    s3_endpoint: str | None = None  # used when the spec names none
    master_addr: str | None = None  # rank 0's address when pod 0 was kept from an earlier attempt


def labels(job: str, attempt: int | None = None, index: int | None = None) -> dict[str, str]:
    out = {JOB_LABEL: job, MANAGED_BY: FIELD_OWNER}
    if attempt is not None:
        out[ATTEMPT_LABEL] = str(attempt)
    if index is not None:
        out[INDEX_LABEL] = str(index)
    return out


def owner_reference(job: JobMeta) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": job.name, "uid": job.uid,
        "controller": True, "blockOwnerDeletion": True,
    }


def object_metadata(job: JobMeta, name: str, extra_labels: Mapping[str, str]) -> dict[str, Any]:
    return {
        "name": name, "namespace": job.namespace, "labels": dict(extra_labels),
        "ownerReferences": [owner_reference(job)],
    }


def pod_name(job: str, attempt: int, index: int) -> str:
    return f"{job}-{attempt}-{index}"


def master_addr(job: str, namespace: str, attempt: int) -> str:
    return pod_address(job, namespace, pod_name(job, attempt, 0))


def pod_address(job: str, namespace: str, pod: str) -> str:
    """A pod's stable DNS name under the job's headless Service (hostname = pod name)."""
    return f"{pod}.{job}.{namespace}.svc"


def restart_in_place_patch(attempt: int, resume_step: int | None, master: str) -> dict[str, Any]:
    """Merge patch moving a kept pod to `attempt`: its label, and the annotations its supervisor
    reads through the control volume (a new attempt restarts its trainer processes)."""
    return {"metadata": {
        "labels": {ATTEMPT_LABEL: str(attempt)},
        "annotations": {
            ATTEMPT_ANNOTATION: str(attempt), MASTER_ADDR_ANNOTATION: master,
            RESUME_ANNOTATION: "" if resume_step is None else str(resume_step),
        },
    }}


def service(job: JobMeta, master_port: int) -> dict[str, Any]:
    """Headless Service giving every pod `<pod>.<job>.<ns>.svc`."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": object_metadata(job, job.name, labels(job.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: job.name},
            "ports": [{"name": "rendezvous", "port": master_port, "targetPort": master_port}],
        },
    }


def network_policy(job: JobMeta, metrics_port: int | None = None) -> dict[str, Any]:
    """NetworkPolicy `<job>`: only the job's own pods reach its pods (rendezvous, collectives,
    any port), except the trainer's metrics port, which any source may scrape (Prometheus runs
    wherever the cluster runs it; the port serves read-only gauges); egress is left alone.
    Policies add up, so another one may open a port more."""
    gang = {"matchLabels": {JOB_LABEL: job.name}}
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": gang}]}]
    if metrics_port is not None:
        ingress.append({"ports": [{"protocol": "TCP", "port": metrics_port}]})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": object_metadata(job, job.name, labels(job.name)),
        "spec": {
            "podSelector": gang,
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _env(spec: TrainingJobSpec, job: JobMeta, plan: PodPlan) -> list[dict[str, Any]]:
    par = spec.parallelism
    nnodes = par.tensor * par.pipeline * plan.data // spec.worker.gpus_per_pod
    ckpt = spec.checkpoint
    contract = TrainerEnv(
        master_addr=plan.master_addr or master_addr(job.name, job.namespace, plan.attempt),
        master_port=plan.master_port, nnodes=nnodes, node_rank=plan.index,
        nproc_per_node=spec.worker.gpus_per_pod, tensor=par.tensor, pipeline=par.pipeline,
        data=plan.data, rank_order=spec.rank_order, attempt=plan.attempt,
        checkpoint_uri=job_prefix(ckpt.uri, job.namespace, job.name) if ckpt else "",
        resume_step=plan.resume_step, job_name=job.name, job_namespace=job.namespace,
        checkpoint_interval=ckpt.interval_steps if ckpt else 0,
        checkpoint_keep=ckpt.keep if ckpt else 3,
        training_config=json.dumps(spec.training, sort_keys=True),
    )
    user = [e.to_wire() for e in (*spec.env, *spec.worker.env)]
    env = user + [{"name": k, "value": v} for k, v in contract.to_env().items()]
    endpoint = (ckpt.endpoint if ckpt else None) or plan.s3_endpoint
    if endpoint:
        env.append({"name": S3_ENDPOINT, "value": endpoint})
    if ckpt and ckpt.credentials_secret:
        for key in (ACCESS_KEY_ID, SECRET_ACCESS_KEY):
            env.append({
                "name": key,
                "valueFrom": {"secretKeyRef": {"name": ckpt.credentials_secret, "key": key}},
            })
    return env


def _resources(spec: TrainingJobSpec) -> dict[str, Any]:
    extra = spec.worker.resources
    gpus = str(spec.worker.gpus_per_pod)
    requests = {**(extra.requests or {} if extra else {}), GPU_RESOURCE: gpus}
    limits = {**(extra.limits or {} if extra else {}), GPU_RESOURCE: gpus}
    return {"requests": requests, "limits": limits}


def _pod_security_context(worker: WorkerSpec) -> dict[str, Any] | None:
    """Restricted: a non-root user and RuntimeDefault seccomp for the whole pod."""
    if worker.pod_security != "Restricted":
        return None
    return {
        "runAsNonRoot": True, "runAsUser": worker.run_as_user, "runAsGroup": worker.run_as_user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context(worker: WorkerSpec) -> dict[str, Any] | None:
    """Restricted: no privilege escalation, no capabilities; Unrestricted: the spec's, if any."""
    if worker.pod_security == "Restricted":
        return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return dict(worker.security_context) if worker.security_context is not None else None


def _shm_volume(worker: WorkerSpec) -> dict[str, Any]:
    """NCCL and DataLoader workers need more /dev/shm than a container runtime's 64 MiB."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if worker.shm_size is not None:
        empty_dir["sizeLimit"] = worker.shm_size
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def _control_volume() -> dict[str, Any]:
    """The pod's annotations as a file the kubelet rewrites when they change: the operator's
    channel to a running trainer (in-place restarts, checkpoint requests)."""
    return {"name": CONTROL_VOLUME, "downwardAPI": {"items": [
        {"path": CONTROL_FILE, "fieldRef": {"fieldPath": "metadata.annotations"}},
    ]}}


def _trainer_container(job: JobMeta, spec: TrainingJobSpec, plan: PodPlan) -> dict[str, Any]:
    worker = spec.worker
    container: dict[str, Any] = {
        "name": CONTAINER, "image": spec.image, "env": _env(spec, job, plan),
        "resources": _resources(spec),
        "ports": [{"name": "rendezvous", "containerPort": plan.master_port},
                  *([{"name": "metrics", "containerPort": spec.metrics_port}] if spec.metrics_port else [])],
        "volumeMounts": [
            {"name": SHM_VOLUME, "mountPath": SHM_DIR},
            {"name": CONTROL_VOLUME, "mountPath": CONTROL_DIR, "readOnly": True},
            *(mount.to_wire() for mount in worker.volume_mounts or []),
        ],
        # the crashed container's last log lines survive as its termination message
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    container_security = _container_security_context(worker)
    if container_security is not None:
        container["securityContext"] = container_security
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if spec.command:
        container["command"] = list(spec.command)
    if spec.args:
        container["args"] = list(spec.args)
    return container


def pod(job: JobMeta, spec: TrainingJobSpec, plan: PodPlan) -> dict[str, Any]:
    """One training pod, gated, pinned to its planned node; the scheduler still binds it."""
    name = pod_name(job.name, plan.attempt, plan.index)
    worker = spec.worker
    # The spec's labels and annotations go first so that the operator's keys win (the API
    # refuses a spec that sets them anyway).
    meta = object_metadata(job, name, {**(worker.labels or {}), **labels(job.name, plan.attempt, plan.index)})
    meta["annotations"] = {
        **(worker.annotations or {}),
        NODE_ANNOTATION: plan.node,
        RESUME_ANNOTATION: "" if plan.resume_step is None else str(plan.resume_step),
        TEMPLATE_ANNOTATION: template_hash(spec),
        ATTEMPT_ANNOTATION: str(plan.attempt),
        MASTER_ADDR_ANNOTATION: plan.master_addr or master_addr(job.name, job.namespace, plan.attempt),
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": job.name,
        "enableServiceLinks": False,
        "schedulingGates": [{"name": GANG_GATE}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [plan.node]},
            ]}],
        }}},
        "tolerations": [t.to_wire() for t in worker.tolerations],
        "containers": [_trainer_container(job, spec, plan)],
        # the operator's volumes first, then the spec's
        "volumes": [_shm_volume(worker), _control_volume(), *(v.to_wire() for v in worker.volumes or [])],
        "automountServiceAccountToken": worker.automount_service_account_token,
    }
    pod_security = _pod_security_context(worker)
    if pod_security is not None:
        pod_spec["securityContext"] = pod_security
    if worker.node_selector:
        pod_spec["nodeSelector"] = dict(worker.node_selector)
    if worker.service_account_name:
        pod_spec["serviceAccountName"] = worker.service_account_name
    if worker.priority_class_name:
        pod_spec["priorityClassName"] = worker.priority_class_name
    if worker.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in worker.image_pull_secrets]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


# Spec fields that do not change what a pod runs: the data degree is a resize, the rest only
# steer placement and restarts.
_NOT_IN_TEMPLATE = ("parallelism", "topology", "failurePolicy", "suspend")


def template_hash(spec: TrainingJobSpec) -> str:
    """A short hash of every spec field the pods are built from; a change rolls the gang."""
    wire = {k: v for k, v in spec.to_wire().items() if k not in _NOT_IN_TEMPLATE}
    wire["parallelism"] = {"tensor": spec.parallelism.tensor, "pipeline": spec.parallelism.pipeline}
    return hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()[:16]


def bind(manifest: dict[str, Any], node: str) -> None:
    """Make a gated pod manifest one created bound to `node` (no gate: nothing waits to be
    released, and no scheduler binds it; the node's kubelet still admits it or refuses it)."""
    manifest["spec"].pop("schedulingGates", None)
    manifest["spec"]["nodeName"] = node


def release_patch() -> dict[str, Any]:
    """Strategic-merge-free patch removing every scheduling gate (JSON merge patch)."""
    return {"spec": {"schedulingGates": None}}
