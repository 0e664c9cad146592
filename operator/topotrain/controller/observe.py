"""What a pass reads besides the watch: the checkpoint Secret and store, the job's children.

Both are cached for `checkpoint_poll` seconds while a job runs quietly; a pass
that is about to start pods reads the store afresh, so the resume step is the
newest committed one at that moment.

Identity is by UID (ownership.py): the checkpoint prefix's owner record is read
with the store, and claimed for this job on its first start; the Service and
the rank-table ConfigMap must be absent or this job's. Either problem becomes
reconcile's `config_problem`, which keeps the gang from being launched and
says why in ConfigValid.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import Reason, TrainingJobStatus
from topotrain.checkpoints import (
    CheckpointStore,
    CommittedCheckpoint,
    PrefixOwner,
    Progress,
    job_prefix,
    operator_store,
)
from topotrain.controller.credentials import SecretProblem, checkpoint_credentials
from topotrain.controller.endpoints import endpoint_problem
from topotrain.controller.indexes import JobKey
from topotrain.controller.kube import Kube
from topotrain.controller.settings import Settings
from topotrain.core import resume
from topotrain.core.decision import UNREAD, Unread
from topotrain.core.ownership import (
    ForeignObject,
    ResumePolicy,
    claim_checkpoints,
    controller_owner,
    owned_by,
)
from topotrain.core.planned import pending
from topotrain.core.rank_table import RankTable
from topotrain.core.reconcile_status import CheckpointView

log = logging.getLogger("topotrain.observe")
Problem = tuple[str, str] | None


class Observer:
    """Reads (and briefly caches) one job's Secret and checkpoint store."""

    def __init__(self, kube: Kube, settings: Settings, uid: str = "") -> None:
        self.kube = kube
        self.settings = settings
        self.uid = uid  # the TrainingJob's metadata.uid; "" skips the ownership checks
        self.run_uid = uid  # the run's identity the checkpoints belong to (core/multikueue.py)
        self.took_over: PrefixOwner | None = None  # our owner record, when it names another run
        self._service_ours = False
        self._stores: dict[tuple[str, str | None, str], CheckpointStore] = {}
        self._cached: tuple[float, Problem, CheckpointView | None] | None = None

    def fresh(self, key: JobKey) -> bool:
        """True when the cached view was read within the last second."""
        return self._cached is not None and time.monotonic() - self._cached[0] < 1.0

    def checkpoint(
        self, key: JobKey, spec: TrainingJobSpec, status: TrainingJobStatus, force: bool = False
    ) -> tuple[Problem, CheckpointView | None]:
        """(config problem, what the store holds); None view: the job has no checkpoint."""
        if spec.checkpoint is None:
            return None, None
        # A planned change waiting for its checkpoint reads the store every pass.
        quiet = status.phase == "Running" and not pending(status.checkpoint_request)
        cached = self._cached
        if cached and not force and quiet and time.monotonic() - cached[0] < self.settings.checkpoint_poll:
            return cached[1], cached[2]
        problem, view = self._read(key, spec, status.start_time is not None or status.attempt > 0,
                                   resume.floor(status))
        self._cached = (time.monotonic(), problem, view)
        return problem, view

    def _read(self, key: JobKey, spec: TrainingJobSpec, started: bool, floor: resume.Floor | None
              ) -> tuple[Problem, CheckpointView | None]:
        ckpt = spec.checkpoint
        assert ckpt is not None
        namespace, name = key
        if ckpt.endpoint:
            outside = endpoint_problem(ckpt.endpoint, self.settings.s3_endpoint,
                                       self.settings.checkpoint_endpoints)
            if outside is not None:  # checked before any request, the Secret's read included
                return (Reason.ENDPOINT_NOT_ALLOWED, outside), CheckpointView(reachable=False, error=outside)
        access = secret = ""
        if ckpt.credentials_secret:
            try:
                access, secret = checkpoint_credentials(self.kube, namespace, ckpt.credentials_secret)
            except SecretProblem as exc:
                return (exc.reason, exc.message), CheckpointView(reachable=False, error=exc.message)
        endpoint = ckpt.endpoint or self.settings.s3_endpoint
        store = self._store(job_prefix(ckpt.uri, namespace, name), endpoint, access, secret)
        try:
            # The newest commit a restart may resume from: not one the gang a planned change
            # replaced made after the step the change restored (resume.py).
            latest, skipped = store.newest_resumable(floor.admits if floor is not None else None)
            progress = store.read_progress()
            request, request_step = _served_request(store, latest, progress)
            failure = store.read_failure() if started else None
            refused = self._claim(store, ckpt.resume_policy, started, latest.step if latest else None)
        except Exception as exc:  # boto3 raises many kinds; all mean "unknown now"
            log.warning("checkpoint store of %s/%s unreadable: %s", namespace, name, exc)
            return None, CheckpointView(reachable=False, error=_short(exc))
        if refused is not None and not started:
            return refused, CheckpointView()  # another run's steps are not this job's checkpoint
        # (a started job keeps its view, heartbeat included: a claim by another job stops
        # further launches, not hang detection)
        return refused, CheckpointView(
            step=latest.step if latest else None, uri=latest.uri if latest else None,
            time=latest.time if latest else None,
            progress_step=progress.step if progress else None,
            progress_time=progress.time if progress else None,
            progress_attempt=progress.attempt if progress else None,
            progress_start=progress.start if progress else None,
            progress_contract=progress.contract if progress else None,
            request=request, request_step=request_step, worker_failure=failure,
            skipped_step=skipped.step if skipped else None,
            skipped_attempt=skipped.attempt if skipped else None,
        )

    def _claim(self, store: CheckpointStore, policy: ResumePolicy, started: bool,
               latest: int | None) -> Problem:
        """Record this job as the prefix's owner, or say why it may not use the prefix."""
        if not self.uid or not self.run_uid:
            return None  # no ownership checks, or the run's identity is not known yet
        claim = claim_checkpoints(uid=self.run_uid, started=started, policy=policy,
                                  owner=store.read_owner(), latest_step=latest, prefix=store.uri,
                                  now=datetime.now(UTC), own_uid=self.uid)
        if claim.write is not None:
            store.write_owner(claim.write)
        self.took_over = claim.took_over
        return claim.problem

    def children(self, key: JobKey, recheck: bool = False, table: bool = True
                 ) -> tuple[Problem, RankTable | Unread | None]:
        """(ownership problem, rank table): the Service and the ConfigMap are absent or ours.

        The Service is read until it is seen to be ours, and again when `recheck` (the
        Actuator met a foreign object last pass); the rank table when `table` or `recheck`, else
        UNREAD (a decision that needs it asks: JobLoop._decision).
        """
        namespace, name = key
        uid = self.uid or None
        self._service_ours = self._service_ours and not recheck
        try:
            if uid is not None and not self._service_ours:
                meta = self.kube.existing("Service", namespace, name)
                if meta is not None and not owned_by(meta, uid):
                    raise ForeignObject("Service", namespace, name, controller_owner(meta), name)
                self._service_ours = meta is not None
        except ForeignObject as exc:
            return exc.problem, None
        return self.rank_table(key) if table or recheck else (None, UNREAD)

    def rank_table(self, key: JobKey) -> tuple[Problem, RankTable | None]:
        """(ownership problem, rank table): the `<job>-ranks` ConfigMap, absent or ours."""
        try:
            return None, self.kube.rank_table(*key, self.uid or None)
        except ForeignObject as exc:
            return exc.problem, None

    def _store(self, prefix: str, endpoint: str | None, access: str, secret: str) -> CheckpointStore:
        key = (prefix, endpoint, access + ":" + secret)
        store = self._stores.get(key)
        if store is None:
            store = operator_store(prefix, endpoint, (access, secret) if access else None)
            self._stores = {key: store}  # one job, one store: drop stale credentials
        return store


def _short(exc: Any) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _served_request(store: CheckpointStore, latest: CommittedCheckpoint | None,
                    progress: Progress | None) -> tuple[str, int | None]:
    """(request, step): the checkpoint request served by a committed step, and that step.

    The newest commit names the request its trainer had served; when it does not name the one the
    heartbeat reports (a replaced gang's SIGTERM save landed after the new gang's request save),
    the step the heartbeat names is read: served once its COMMITTED names the same request.
    """
    request, step = (latest.request, latest.step) if latest is not None and latest.request else ("", None)
    served = progress.checkpoint_request if progress is not None else None
    if served is not None and served.value != request:
        commit = store.read_commit(served.step)
        if commit is not None and commit.request == served.value:
            request, step = served.value, served.step
    return request, step
