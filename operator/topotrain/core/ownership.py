"""Which objects and checkpoints a TrainingJob may call its own: identity by UID, not by name.

A name outlives its owner: a job deleted and re-created under the same name is
a different object with a different `metadata.uid`, while its predecessor's
pods may still be terminating, a user's Service may carry the same name, and
the checkpoint prefix `<uri>/<namespace>/<name>` still holds the old run. So:

- a child (Pod, Service, ConfigMap) is the job's only when its controller
  owner reference carries the job's UID; anything else of that name is
  foreign: never adopted, never overwritten, never deleted, and reported;
- the checkpoint prefix records its owner (`owner.json`, written by the
  operator on the job's first start); a job starts from checkpoints another
  job wrote only when `spec.checkpoint.resumePolicy: Always` says so, and then
  status says whose they were (`status.resumedFrom`).

Pure: no Kubernetes or S3 client; the edges (controller/kube.py, observe.py)
read the objects and call these functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from topotrain import KIND
from topotrain.api.status import Reason
from topotrain.checkpoints import PrefixOwner

ResumePolicy = Literal["IfOwned", "Always"]
Problem = tuple[str, str]  # (reason, message), as reconcile's Observed.config_problem


@dataclass(frozen=True)
class Owner:
    """The controller owner reference of an object."""

    kind: str
    name: str
    uid: str


def controller_owner(metadata: Mapping[str, Any]) -> Owner | None:
    """The owner reference with `controller: true` (camelCase wire metadata), if any."""
    for ref in metadata.get("ownerReferences") or []:
        if ref.get("controller"):
            return Owner(str(ref.get("kind") or ""), str(ref.get("name") or ""), str(ref.get("uid") or ""))
    return None


def owned_by(metadata: Mapping[str, Any], uid: str) -> bool:
    """True when the object's controller is the object with `uid`."""
    owner = controller_owner(metadata)
    return owner is not None and bool(uid) and owner.uid == uid


class ForeignObject(Exception):
    """An object the job would create or update exists and belongs to someone else."""

    def __init__(self, kind: str, namespace: str, name: str, owner: Owner | None, job: str) -> None:
        self.reason = Reason.FOREIGN_OBJECT
        self.message = foreign_message(kind, namespace, name, owner, job)
        super().__init__(self.message)

    @property
    def problem(self) -> Problem:
        return self.reason, self.message


def foreign_message(kind: str, namespace: str, name: str, owner: Owner | None, job: str,
                    terminating: bool = False) -> str:
    """What a user reads in the condition: the object, whose it is, and what to do."""
    head = f"{kind} {namespace}/{name} exists and is not owned by this TrainingJob"
    if owner is not None and owner.kind == KIND and owner.name == job:
        going = "is being deleted" if terminating else "awaits the garbage collector"
        return (f"{head}: it belongs to an earlier TrainingJob {job} (uid {owner.uid}) and {going}; "
                "waiting for it to go")
    if owner is not None:
        return f"{head} (its controller is {owner.kind} {owner.name}); delete or rename it"
    return f"{head}; delete or rename it"


# --- checkpoints -------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """What to do with the checkpoint prefix before the job (re)starts.

    `write`: the owner record to store (None: leave it); `problem`: do not start, say why;
    `took_over`: the job's own record when it says the job resumed another run's checkpoints.
    """

    write: PrefixOwner | None = None
    problem: Problem | None = None
    took_over: PrefixOwner | None = None


def claim_checkpoints(
    *, uid: str, started: bool, policy: ResumePolicy, owner: PrefixOwner | None,
    latest_step: int | None, prefix: str, now: datetime, own_uid: str | None = None,
) -> Claim:
    """Decide whether the run with `uid` may use the checkpoints under `prefix`.

    `uid` is the run's identity: the job's own UID, or, for a copy of a job that Kueue's
    MultiKueue dispatched to this cluster, the manager job's (`own_uid` is then the copy's own),
    so a copy dispatched again elsewhere resumes the run's checkpoints under the default IfOwned,
    and status says it went on from a run started elsewhere (a `took_over` record naming the run
    itself). `started`: the job has placed a gang before (status.startTime), so the prefix is its
    own even without a record (jobs that started under an operator that wrote none). `owner`:
    the prefix's owner record, if any; `latest_step`: its highest committed step, if any.
    """
    mine = PrefixOwner(uid=uid, created=now)
    if owner is not None and owner.uid == uid:
        if not started and latest_step is not None and own_uid not in (None, uid):
            return Claim(took_over=PrefixOwner(uid=uid, created=now, resumed_uid=uid,
                                               resumed_step=latest_step))
        return Claim(took_over=owner if owner.resumed_step is not None else None)
    if started:
        if owner is None:
            return Claim(write=mine)
        return Claim(problem=(Reason.FOREIGN_CHECKPOINTS, (
            f"{prefix} was claimed by another TrainingJob (uid {owner.uid}, {_when(owner)}) after "
            "this one started; two jobs must not share a checkpoint prefix: give one of them "
            "another spec.checkpoint.uri")))
    if latest_step is None:
        return Claim(write=mine)  # nothing committed to resume: the prefix starts afresh
    if policy == "Always":
        taken = PrefixOwner(uid=uid, created=now, resumed_uid=owner.uid if owner else "",
                            resumed_step=latest_step)
        return Claim(write=taken, took_over=taken)
    whose = (f"by another TrainingJob (uid {owner.uid}, {_when(owner)})" if owner is not None
             else "by a run that left no owner record (another job, or files copied there)")
    return Claim(problem=(Reason.FOREIGN_CHECKPOINTS, (
        f"{prefix} holds committed checkpoints up to step {latest_step} written {whose}; "
        "set spec.checkpoint.resumePolicy: Always to resume from them, or use another "
        "spec.checkpoint.uri (or delete them) to start afresh")))


def _when(owner: PrefixOwner) -> str:
    return f"created {owner.created.strftime('%Y-%m-%dT%H:%M:%SZ')}"
