"""What one reconcile pass takes and gives: `Observed` in; `Decision`, its actions and the one
status to write, out.

The controller builds `Observed` from the watch, the checkpoint store and the job's
children, and from what acting on the last decision taught it (`Refusal`, `PodsAccepted`: the
API server's answer to its pod creates, which the status says from this pass on);
`reconcile.reconcile` returns the `Decision`; the controller carries it out (`Launch` creates an
attempt's pods behind the gang gate, `Relabel` moves kept pods onto an in-place restart's
attempt) and writes the status once.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import JobTemplateStatus, TrainingJobStatus
from topotrain.checkpoints import PrefixOwner
from topotrain.core import planned, policy
from topotrain.core.kueue_admission import QueueGate
from topotrain.core.planning import Planner
from topotrain.core.rank_table import RankTable
from topotrain.core.reconcile_status import CheckpointView


class NeedsRankTable(Exception):
    """A decision taken before the job's rank table was read asked for it: the pass reads it
    (an API call, never made while deciding) and decides again. Most passes never ask (a Running
    job's heartbeat), so they make no GET for it (JobLoop._decision)."""


class Unread(enum.Enum):
    """`Observed.rank_table` not read yet: `Observed.ranks()` raises NeedsRankTable."""

    RANK_TABLE = "unread"


UNREAD = Unread.RANK_TABLE


@dataclass(frozen=True)
class Refusal:
    """The API server refused pods of the gang the last pass launched (a PodsCreated=False
    reason, and its words: transitions.refusal_condition)."""

    reason: str
    message: str


@dataclass(frozen=True)
class PodsAccepted:
    """The API server created every pod of the last pass's launch after refusing earlier ones."""

    attempt: int
    count: int


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile pass looks at."""

    name: str
    namespace: str
    generation: int
    spec: TrainingJobSpec
    status: TrainingJobStatus
    pods: tuple[policy.PodView, ...]
    nodes: Mapping[str, policy.NodeView]
    planner: Planner
    now: datetime
    checkpoint: CheckpointView | None = None  # None: the job has no spec.checkpoint
    # The job's rank table (None: there is none), or UNREAD: read only if a decision asks for it
    # (ranks()).
    rank_table: RankTable | Unread | None = None
    config_problem: tuple[str, str] | None = None  # (reason, message)
    strategy: str = "incremental"  # or "recreate" (the full-gang baseline)
    last_refusal: datetime | None = None  # when the API server last refused this job's pods
    template: str = ""  # hash of the pod template the spec asks for (manifests.template_hash)
    # The same cluster with the job's avoided nodes back in: used only when nothing else fits,
    # so avoiding nodes that failed the job never strands it (None: no node is avoided).
    unavoiding_planner: Planner | None = None
    # A cordoned node of the running gang moves the gang off it, checkpointing first (False: the
    # gang stays until an eviction, as any pod would).
    move_off_cordoned: bool = True
    # Seconds a planned change waits for the checkpoint it asks for (0: it asks none).
    checkpoint_request_timeout: float = planned.CHECKPOINT_REQUEST_TIMEOUT
    queue: QueueGate | None = None  # None: the job is not sent to a Kueue queue
    # What acting on the last pass's decision found, for this pass's status to say.
    refusal: Refusal | None = None
    accepted: PodsAccepted | None = None
    # The owner record of the job's checkpoint prefix, when it says the job took over another
    # run's checkpoints (spec.checkpoint.resumePolicy: Always): status.resumedFrom.
    took_over: PrefixOwner | None = None
    # The TrainingJobTemplate generation the spec was resolved over (core/templates.py).
    job_template: JobTemplateStatus | None = None

    def ranks(self) -> RankTable | None:
        """The job's rank table (None: there is none); raises NeedsRankTable where it was not read."""
        if isinstance(self.rank_table, Unread):
            raise NeedsRankTable
        return self.rank_table


@dataclass(frozen=True)
class Launch:
    """Create the pods of one attempt (gated), then release the gate on all of them."""

    attempt: int
    data: int
    pool: str | None
    assignments: Mapping[int, str]  # pod index -> node, every index of the gang
    resume_step: int | None
    mode: str
    only: tuple[int, ...] = ()  # create just these indices (finishing a half-created gang)
    release: bool = True  # False: older pods still hold the nodes; a later pass releases the gate
    in_place: bool = False  # the other indices are kept pods of an in-place restart
    master_addr: str | None = None  # rank 0's address when pod 0 is a kept pod


@dataclass(frozen=True)
class Relabel:
    """Move kept pods to the attempt of an in-place restart (label and control annotations)."""

    pods: tuple[str, ...]
    attempt: int
    resume_step: int | None
    master_addr: str


@dataclass
class Decision:
    """The actions of one pass and the status to write."""

    status: TrainingJobStatus
    delete: list[str] = field(default_factory=list)
    # Delete them with a grace period of 1 s: their SIGTERM checkpoint cannot commit (a rank of the
    # gang is on a lost node), so waiting for it only keeps their GPUs from the next attempt.
    delete_now: bool = False
    launch: Launch | None = None
    relabel: Relabel | None = None
    release: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue_after: float | None = None
    restart_reason: str | None = None  # for the restarts metric
    recovered_seconds: float | None = None  # for the recovery histogram
    first_step: tuple[float, str] | None = None  # (time to first step, cause) for its histogram
    checkpoint_request: planned.CheckpointAsk | None = None  # before a planned change (planned.py)
    placement_cost: float | None = None
    # Kueue evicted the job and none of its pods is left: give the quota back (queue_link.py
    # clears the Workload's admission, so Kueue requeues it).
    release_quota: bool = False
    # A node of Kueue's topology assignment is lost and the gang fits nowhere else in it: hand the
    # job back to Kueue for a new assignment (queue_link.py evicts the Workload with this message).
    hand_back: str | None = None
    delete_job: bool = False  # spec.ttlSecondsAfterFinished passed: delete the job itself
