"""The paths and records of the checkpoint layout (checkpoints.py), as the trainer writes and
the operator reads them.

`job_prefix`/`step_dir`/`attempt_dir` name the directories; COMMITTED, progress.json,
failure.json and owner.json hold JSON documents, typed here, with the UTC time format they
share. Stdlib only: `topotrain_sdk.checkpoints` exports every name here, and the trainer and the
operator import them from there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

STEP_PREFIX = "step-"


def job_prefix(uri: str, namespace: str, name: str) -> str:
    """`<uri>/<namespace>/<name>`: where one job's checkpoints live."""
    split_uri(uri)  # validates the scheme and bucket
    return f"{uri.rstrip('/')}/{namespace}/{name}"


def step_dir(prefix: str, step: int) -> str:
    """`<prefix>/step-0000000042`: the directory of one checkpoint."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{prefix.rstrip('/')}/{STEP_PREFIX}{step:010d}"


def attempt_dir(attempt: int, token: str) -> str:
    """`attempt-3-9f2c41d0`: the directory one trainer run's save of a step writes into."""
    return f"attempt-{attempt}-{token}"


def split_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b")."""
    if not uri.startswith("s3://"):
        raise ValueError(f"checkpoint uri {uri!r} must start with s3://")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"checkpoint uri {uri!r} names no bucket")
    return bucket, key.strip("/")


def utc_now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A complete checkpoint: its COMMITTED marker was written after every shard."""

    step: int
    uri: str  # the step directory, s3://bucket/.../step-0000000042
    time: datetime  # UTC, when it was committed
    mesh: Mapping[str, int] = field(default_factory=dict)  # {"tensor", "pipeline", "data"}
    bytes: int = 0  # total size of the shard files
    shards: str = ""  # the attempt directory holding them; "" = the step directory (old layout)
    # The last checkpoint request (annotation value) the trainer had served when it saved this
    # step: served by this step's save or an earlier one, so this checkpoint is at or after it.
    request: str = ""
    saved_by: int | None = None  # the attempt whose trainer saved it (None: not recorded)

    @property
    def attempt(self) -> int | None:
        """The attempt that saved this step: recorded in COMMITTED, else read off `shards`."""
        if self.saved_by is not None:
            return self.saved_by
        match = re.match(r"^attempt-(\d+)-", self.shards)
        return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Progress:
    """The trainer's heartbeat: the last step it finished, and in which attempt."""

    step: int
    time: datetime  # UTC
    attempt: int
    start: AttemptStart | None = None
    checkpoint_request: ServedRequest | None = None  # the last checkpoint request the trainer served
    contract: int | None = None  # the contract version the trainer's SDK speaks (None: older SDK)


@dataclass(frozen=True)
class ServedRequest:
    """A checkpoint request (the `topotrain.io/checkpoint-request` value) and the step whose
    save serves it; that step's COMMITTED carries the same `request` once the save is complete."""

    value: str
    step: int

    def to_json(self) -> dict[str, object]:
        return {"value": self.value, "step": self.step}

    @classmethod
    def from_json(cls, doc: object) -> ServedRequest | None:
        if not isinstance(doc, dict):
            return None
        try:
            return cls(str(doc["value"]), int(doc["step"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class AttemptStart:
    """How the attempt that writes progress.json started (the trainer's clock, UTC).

    From these the operator splits a recovery's time to first step into phases.
    """

    process: datetime  # the trainer process began (before imports and rendezvous)
    first_step: int  # the first step this attempt completed
    first_step_time: datetime
    load_seconds: float = 0.0  # restoring the checkpoint

    def to_json(self) -> dict[str, object]:
        return {"process": format_time(self.process), "firstStep": self.first_step,
                "firstStepTime": format_time(self.first_step_time),
                "loadSeconds": round(self.load_seconds, 3)}

    @classmethod
    def from_json(cls, doc: object) -> AttemptStart | None:
        if not isinstance(doc, dict):
            return None
        try:
            return cls(parse_time(str(doc["process"])), int(doc["firstStep"]),
                       parse_time(str(doc["firstStepTime"])), float(doc.get("loadSeconds", 0.0)))
        except (KeyError, TypeError, ValueError):
            return None  # an optional record: a malformed one is ignored, not fatal


@dataclass(frozen=True)
class WorkerFailure:
    """failure.json: a trainer rank of pod `node_rank` failed in `attempt` with `exit_code`.

    Its supervisor wrote it and stays up with its warm spares, waiting for the operator's next
    attempt (a restart in place that keeps every pod), instead of exiting and failing the pod.
    """

    attempt: int
    node_rank: int
    exit_code: int
    time: datetime  # UTC, the supervisor's clock
    pod: str = ""

    def to_json(self) -> dict[str, object]:
        return {"attempt": self.attempt, "nodeRank": self.node_rank, "exitCode": self.exit_code,
                "time": format_time(self.time), "pod": self.pod}


@dataclass(frozen=True)
class PrefixOwner:
    """owner.json: the TrainingJob whose checkpoints live under a job prefix, by its UID.

    `resumed_uid`/`resumed_step`: set when that job started from another run's checkpoints
    (spec.checkpoint.resumePolicy: Always); `resumed_uid` is "" when that run left no record.
    """

    uid: str
    created: datetime  # UTC, when the operator claimed the prefix
    resumed_uid: str | None = None
    resumed_step: int | None = None
