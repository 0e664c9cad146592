"""The operator -> trainer contract: the environment of every training pod.

Both sides import this module; nothing else spells these names. Pure stdlib so
the trainer image needs neither kopf nor a Kubernetes client.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
NNODES = "NNODES"
NODE_RANK = "NODE_RANK"
NPROC_PER_NODE = "NPROC_PER_NODE"
WORLD_SIZE = "WORLD_SIZE"
TP = "TOPOTRAIN_TP"
PP = "TOPOTRAIN_PP"
DP = "TOPOTRAIN_DP"
RANK_ORDER = "TOPOTRAIN_RANK_ORDER"
ATTEMPT = "TOPOTRAIN_ATTEMPT"
CHECKPOINT_URI = "TOPOTRAIN_CHECKPOINT_URI"
RESUME_STEP = "TOPOTRAIN_RESUME_STEP"
JOB_NAME = "TOPOTRAIN_JOB_NAME"
JOB_NAMESPACE = "TOPOTRAIN_JOB_NAMESPACE"
CHECKPOINT_INTERVAL = "TOPOTRAIN_CHECKPOINT_INTERVAL"
CHECKPOINT_KEEP = "TOPOTRAIN_CHECKPOINT_KEEP"
TRAINING_CONFIG = "TOPOTRAIN_TRAINING_CONFIG"  # JSON of spec.training
# The version of this contract the operator speaks (absent: an operator older than versions,
# read as 0). The trainer's SDK reports its own in progress.json ("contract"), so each side can
# tell an older other side: the operator shows it in status.trainer, the SDK logs a mismatch.
CONTRACT_VERSION_ENV = "TOPOTRAIN_CONTRACT_VERSION"
CONTRACT_VERSION = 1
S3_ENDPOINT = "AWS_ENDPOINT_URL_S3"
ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"

# The pod's annotations as a downwardAPI volume file: the operator's requests to a running
# trainer, with no API access from the pod. kubelet rewrites the file when they change.
CONTROL_DIR = "/etc/topotrain"
CONTROL_DIR_ENV = "TOPOTRAIN_CONTROL_DIR"  # overrides CONTROL_DIR (tests, local runs)
CONTROL_FILE = "annotations"
# Any new value asks every rank for a checkpoint at the next step boundary (training goes on).
CHECKPOINT_REQUEST = "topotrain.io/checkpoint-request"
# A request that ends with PLANNED_STOP_MARK is a planned stop's (planned_stop_request): the gang
# is stopped (SIGTERM) once its save commits, so a trainer that serves it trains no further step of
# the attempt it names, waiting for that SIGTERM (docs/trainer.md, "Stopping and checkpoint
# requests"); the operator clears the annotation when the change is called off.
PLANNED_STOP_MARK = "+stop"
# A test aid (the bundled trainer's training.holdAtStep, docs/trainer.md): any value releases
# a trainer held at that step; a value `hold_release_of(attempt)` only that attempt's (a later
# attempt of the same pods holds again). Tests annotate the pods; the operator never sets it.
HOLD_RELEASE = "topotrain.io/hold-release"
_RELEASE_OF = "attempt-"


def hold_release_of(attempt: int) -> str:
    """The HOLD_RELEASE value that releases only attempt `attempt`."""
    return f"{_RELEASE_OF}{attempt}"


def hold_released(value: str, attempt: int) -> bool:
    """Whether a HOLD_RELEASE value releases a hold of attempt `attempt`."""
    if not value.startswith(_RELEASE_OF):
        return bool(value)
    return value == hold_release_of(attempt)

# In-place restart: the attempt a running pod must train now (the supervisor restarts its ranks
# when it goes up), with that attempt's resume step and rank-0 address. The operator sets them.
CONTROL_VOLUME = "topotrain-control"  # the pod's downwardAPI volume, mounted at CONTROL_DIR
ATTEMPT_ANNOTATION = "topotrain.io/attempt"  # the attempt the pod must run now
RESUME_STEP_ANNOTATION = "topotrain.io/resume-step"  # "" = start fresh
MASTER_ADDR_ANNOTATION = "topotrain.io/master-addr"  # rank 0's address for that attempt
MASTER_PORT_ANNOTATION = "topotrain.io/master-port"  # optional: rank 0's port for that attempt

# Every pod's memory-backed /dev/shm (NCCL, data loaders). With CONTROL_VOLUME these are the
# pod's own volumes: a job's worker.volumes and volumeMounts keep clear of their names and paths.
SHM_VOLUME = "dshm"
SHM_DIR = "/dev/shm"

# A trainer's exit codes, as the operator and the pod's supervisor read them.
EXIT_DONE = 0  # every step trained
# A trainer pod's exit code after SIGTERM once the checkpoint of its current step committed
# (EX_TEMPFAIL): a planned stop with nothing lost, never the application's failure.
EXIT_STOPPED = 75
# A collective lost a peer in another pod: this rank's own pod is healthy (its supervisor keeps
# it up for the operator's next attempt, a restart in place).
EXIT_PEER_LOST = 76
# A configuration or contract error (EX_CONFIG): retrying cannot fix it, the job fails.
EXIT_BAD_CONFIG = 78

DEFAULT_MASTER_PORT = 29500
# The rendezvous is scoped to the attempt: rank 0 serves the store at MASTER_ADDR:MASTER_PORT and
# writes its TOPOTRAIN_ATTEMPT under RENDEZVOUS_ATTEMPT_KEY; every other rank reads it first and
# refuses a store of another attempt (a lagging rank of attempt N never joins attempt N+1), then
# keeps its process group's keys under `rendezvous_prefix(attempt)`.
RENDEZVOUS_ATTEMPT_KEY = "topotrain/attempt"


def rendezvous_prefix(attempt: int) -> str:
    return f"topotrain/attempt-{attempt}/"


# The bundled trainer's Prometheus port (local rank 0 of each pod; spec.training.metricsPort, 0 off).
DEFAULT_METRICS_PORT = 9400
RANK_ORDERS = ("tp-pp-dp", "tp-dp-pp")
# Environment keys the operator owns; a user's spec.worker.env cannot override them.
RESERVED = frozenset(
    {
        MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NPROC_PER_NODE, WORLD_SIZE,
        TP, PP, DP, RANK_ORDER, ATTEMPT, CHECKPOINT_URI, RESUME_STEP, JOB_NAME,
        JOB_NAMESPACE, CHECKPOINT_INTERVAL, CHECKPOINT_KEEP, TRAINING_CONFIG, CONTRACT_VERSION_ENV,
    }
)


class ContractError(ValueError):
    """The pod environment does not satisfy the contract."""


@dataclass(frozen=True)
class TrainerEnv:
    """What one pod of the gang is told about its place in the job."""

    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int
    nproc_per_node: int
    tensor: int
    pipeline: int
    data: int
    rank_order: str = "tp-pp-dp"
    attempt: int = 0
    checkpoint_uri: str = ""
    resume_step: int | None = None
    job_name: str = ""
    job_namespace: str = ""
    checkpoint_interval: int = 0
    checkpoint_keep: int = 3
    training_config: str = "{}"
    contract_version: int = CONTRACT_VERSION  # the operator's; 0 parsed from an older operator

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def validate(self) -> None:
        if self.rank_order not in RANK_ORDERS:
            raise ContractError(f"{RANK_ORDER}={self.rank_order!r}: must be one of {RANK_ORDERS}")
        if self.tensor * self.pipeline * self.data != self.world_size:
            raise ContractError(
                f"{TP}*{PP}*{DP}={self.tensor * self.pipeline * self.data} "
                f"!= {WORLD_SIZE}={self.world_size} ({NNODES}*{NPROC_PER_NODE})"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ContractError(f"{NODE_RANK}={self.node_rank} outside [0, {self.nnodes})")

    def to_env(self) -> dict[str, str]:
        """The environment variables the operator sets on the pod."""
        self.validate()
        return {
            MASTER_ADDR: self.master_addr,
            MASTER_PORT: str(self.master_port),
            NNODES: str(self.nnodes),
            NODE_RANK: str(self.node_rank),
            NPROC_PER_NODE: str(self.nproc_per_node),
            WORLD_SIZE: str(self.world_size),
            TP: str(self.tensor),
            PP: str(self.pipeline),
            DP: str(self.data),
            RANK_ORDER: self.rank_order,
            ATTEMPT: str(self.attempt),
            CHECKPOINT_URI: self.checkpoint_uri,
            RESUME_STEP: "" if self.resume_step is None else str(self.resume_step),
            JOB_NAME: self.job_name,
            JOB_NAMESPACE: self.job_namespace,
            CHECKPOINT_INTERVAL: str(self.checkpoint_interval),
            CHECKPOINT_KEEP: str(self.checkpoint_keep),
            TRAINING_CONFIG: self.training_config,
            CONTRACT_VERSION_ENV: str(self.contract_version),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainerEnv:
        """Parse the contract; raises ContractError naming the variable."""
        env = os.environ if env is None else env

        def req(key: str) -> str:
            value = env.get(key, "")
            if value == "":
                raise ContractError(f"{key} is not set")
            return value

        def integer(key: str, default: int | None = None) -> int:
            raw = env.get(key, "")
            if raw == "":
                if default is None:
                    raise ContractError(f"{key} is not set")
                return default
            try:
                return int(raw)
            except ValueError:
                raise ContractError(f"{key}={raw!r} is not an integer") from None

        resume_raw = env.get(RESUME_STEP, "")
        nnodes = integer(NNODES, 1)
        nproc = integer(NPROC_PER_NODE, 1)
        parsed = cls(
            master_addr=env.get(MASTER_ADDR, "127.0.0.1") or "127.0.0.1",
            master_port=integer(MASTER_PORT, DEFAULT_MASTER_PORT),
            nnodes=nnodes,
            node_rank=integer(NODE_RANK, 0),
            nproc_per_node=nproc,
            tensor=integer(TP, 1),
            pipeline=integer(PP, 1),
            data=integer(DP, nnodes * nproc),
            rank_order=env.get(RANK_ORDER, "tp-pp-dp") or "tp-pp-dp",
            attempt=integer(ATTEMPT, 0),
            checkpoint_uri=env.get(CHECKPOINT_URI, ""),
            resume_step=integer(RESUME_STEP) if resume_raw else None,
            job_name=env.get(JOB_NAME, ""),
            job_namespace=env.get(JOB_NAMESPACE, ""),
            checkpoint_interval=integer(CHECKPOINT_INTERVAL, 0),
            checkpoint_keep=integer(CHECKPOINT_KEEP, 3),
            training_config=env.get(TRAINING_CONFIG, "{}") or "{}",
            contract_version=integer(CONTRACT_VERSION_ENV, 0),
        )
        parsed.validate()
        return parsed


def rank_coords(rank: int, tensor: int, pipeline: int, data: int, order: str) -> tuple[int, int, int]:
    """(tp, pp, dp) coordinates of a global rank under the rank order (innermost first)."""
    if order == "tp-pp-dp":
        return rank % tensor, (rank // tensor) % pipeline, rank // (tensor * pipeline)
    if order == "tp-dp-pp":
        return rank % tensor, rank // (tensor * data), (rank // tensor) % data
    raise ContractError(f"unknown rank order {order!r}")


def rank_of(tp: int, pp: int, dp: int, tensor: int, pipeline: int, data: int, order: str) -> int:
    """Inverse of rank_coords."""
    if order == "tp-pp-dp":
        return (dp * pipeline + pp) * tensor + tp
    if order == "tp-dp-pp":
        return (pp * data + dp) * tensor + tp
    raise ContractError(f"unknown rank order {order!r}")


def control_path(env: Mapping[str, str] | None = None) -> Path:
    """The downwardAPI annotations file: `$TOPOTRAIN_CONTROL_DIR/annotations`, else CONTROL_DIR's."""
    env = os.environ if env is None else env
    return Path(env.get(CONTROL_DIR_ENV) or CONTROL_DIR) / CONTROL_FILE


def read_control(path: Path | str) -> dict[str, str]:
    """Parse kubelet's downwardAPI `key="value"` lines (Go-quoted values); {} when absent.

    A line that does not parse is skipped: kubelet swaps the file atomically, so a
    malformed line is not a half-written one, and one bad annotation must not hide the rest.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    control: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key.strip():
            continue
        raw = raw.strip()
        try:
            value = json.loads(raw) if raw.startswith('"') else raw
        except ValueError:
            value = raw[1:-1] if raw.endswith('"') and len(raw) >= 2 else raw
        control[key.strip()] = str(value)
    return control


def format_control(annotations: Mapping[str, str]) -> str:
    """The file a kubelet writes for `metadata.annotations` (sorted keys, quoted values)."""
    return "".join(f"{k}={json.dumps(v, ensure_ascii=False)}\n" for k, v in sorted(annotations.items()))


def with_control(env: TrainerEnv, control: Mapping[str, str]) -> TrainerEnv:
    """The environment of the attempt the control file names (the env's own where it is silent).

    Raises ContractError when an annotation is present but malformed.
    """
    raw_attempt = control.get(ATTEMPT_ANNOTATION, "")
    if raw_attempt == "":
        return env
    try:
        attempt = int(raw_attempt)
        resume_raw = control.get(RESUME_STEP_ANNOTATION, "")
        resume = int(resume_raw) if resume_raw else None
        port_raw = control.get(MASTER_PORT_ANNOTATION, "")
        port = int(port_raw) if port_raw else env.master_port
    except ValueError as err:
        raise ContractError(f"control file {CONTROL_FILE}: {err}") from None
    return replace(
        env, attempt=attempt, resume_step=resume, master_port=port,
        master_addr=control.get(MASTER_ADDR_ANNOTATION) or env.master_addr,
    )


def planned_stop_request(reason: str, attempt: int, when: str) -> str:
    """The checkpoint-request value of a planned change (`reason`: rollout, resize, drain, evict,
    suspend) asked of `attempt` at `when`: unique per request, and marked as a planned stop."""
    return f"{reason}-{attempt}-{when}{PLANNED_STOP_MARK}"


def planned_stop_attempt(value: str) -> int | None:
    """The attempt a planned stop's request value names; None for any other value."""
    if not value.endswith(PLANNED_STOP_MARK):
        return None
    parts = value.split("-", 2)
    if len(parts) < 3 or not parts[1].isdigit():
        return None
    return int(parts[1])
