"""What the operator has seen of the trainer's side of the contract, and what that costs.

A trainer that does not cooperate still trains, but silently loses what topotrain adds: with no
heartbeat there is no hang detection, with no commit every restart begins at step 0, and a
checkpoint request that times out makes a planned change lose the steps since the last commit.
`seen` accumulates the evidence over the job's life (status.trainer); `verdict` turns it into
the TrainerCooperation condition, whose message names each gap and its consequence. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from topotrain.api.status import Reason, TrainerStatus
from topotrain.contract import CONTRACT_VERSION


@dataclass(frozen=True)
class Seen:
    """One pass's evidence (from the checkpoint store and the status)."""

    heartbeat: bool = False  # a progress.json is there
    contract: int | None = None  # the contract version that heartbeat reports
    commit: bool = False  # a COMMITTED step is there
    request_state: str | None = None  # status.checkpointRequest.state


def seen(before: TrainerStatus | None, now: Seen) -> TrainerStatus:
    """status.trainer after this pass: nothing seen once is forgotten; the contract version and
    the requests' outcome are the latest."""
    old = before or TrainerStatus()
    requests = {"Committed": "Honoured", "TimedOut": "TimedOut"}.get(now.request_state or "")
    return TrainerStatus(
        heartbeat=old.heartbeat or now.heartbeat,
        commits=old.commits or now.commit,
        checkpoint_requests=requests or old.checkpoint_requests,  # type: ignore[arg-type]
        contract_version=now.contract if now.heartbeat else old.contract_version,
    )


@dataclass(frozen=True)
class Verdict:
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str


def gaps(trainer: TrainerStatus, operator_contract: int = CONTRACT_VERSION) -> list[str]:
    """Each cooperation not seen, with what the job loses by it."""
    out = []
    if not trainer.heartbeat:
        out.append("hang detection off: no heartbeat seen (progress.json)")
    if not trainer.commits:
        out.append("no commit seen: a restart begins again at step 0")
    if trainer.checkpoint_requests == "TimedOut":
        out.append("the last checkpoint request timed out: that planned change lost the steps "
                   "since the commit before it")  # fmt: skip
    version = trainer.contract_version
    if trainer.heartbeat and version is None:
        out.append(f"the trainer reports no contract version: its SDK is older than the operator's "
                   f"contract version {operator_contract}")  # fmt: skip
    elif version is not None and version != operator_contract:
        older = "trainer's SDK" if version < operator_contract else "operator"
        out.append(f"the trainer speaks contract version {version}, the operator {operator_contract}: "
                   f"upgrade the {older}")  # fmt: skip
    return out


def verdict(trainer: TrainerStatus, *, store: bool, ran: bool,
            operator_contract: int = CONTRACT_VERSION) -> Verdict:
    """The TrainerCooperation condition. `store`: the job has a checkpoint store (spec.checkpoint);
    `ran`: its gang has been Running (before that, nothing can have been seen)."""
    if not store:
        return Verdict("False", Reason.NO_CHECKPOINT_STORE, "no spec.checkpoint: hang detection off "
                       "(no heartbeat can be seen) and every restart begins at step 0")  # fmt: skip
    if not ran and not trainer.heartbeat and not trainer.commits:
        return Verdict("Unknown", Reason.TRAINER_NOT_SEEN, "the trainer has not run yet")
    missing = gaps(trainer, operator_contract)
    if missing:
        return Verdict("False", Reason.TRAINER_PARTIAL, "; ".join(missing))
    requests = ", checkpoint requests honoured" if trainer.checkpoint_requests == "Honoured" else ""
    return Verdict("True", Reason.TRAINER_COOPERATES,
                   f"heartbeat and commits seen{requests} (contract version {trainer.contract_version})")
