"""What a pass reads besides the watch: the checkpoint Secret and the checkpoint store.

Both are cached for `checkpoint_poll` seconds while a job runs quietly; a pass
that is about to start pods reads the store afresh, so the resume step is the
newest committed one at that moment.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from topotrain.api import TrainingJobSpec
from topotrain.checkpoints import CheckpointStore, job_prefix, operator_store
from topotrain.kube import Kube, SecretProblem
from topotrain.reconcile_status import CheckpointView
from topotrain.settings import Settings
from topotrain.snapshot import JobKey
from topotrain.status import TrainingJobStatus

log = logging.getLogger("topotrain.observe")
Problem = tuple[str, str] | None


class Observer:
    """Reads (and briefly caches) one job's Secret and checkpoint store."""

    def __init__(self, kube: Kube, settings: Settings) -> None:
        self.kube = kube
        self.settings = settings
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
        quiet = status.phase == "Running"
        cached = self._cached
        if cached and not force and quiet and time.monotonic() - cached[0] < self.settings.checkpoint_poll:
            return cached[1], cached[2]
        problem, view = self._read(key, spec)
        self._cached = (time.monotonic(), problem, view)
        return problem, view

    def _read(self, key: JobKey, spec: TrainingJobSpec) -> tuple[Problem, CheckpointView | None]:
        ckpt = spec.checkpoint
        assert ckpt is not None
        namespace, name = key
        access = secret = ""
        if ckpt.credentials_secret:
            try:
                access, secret = self.kube.checkpoint_credentials(namespace, ckpt.credentials_secret)
            except SecretProblem as exc:
                return (exc.reason, exc.message), CheckpointView(reachable=False, error=exc.message)
        endpoint = ckpt.endpoint or self.settings.s3_endpoint
        store = self._store(job_prefix(ckpt.uri, namespace, name), endpoint, access, secret)
        try:
            latest = store.latest_committed()
            progress = store.read_progress()
        except Exception as exc:  # boto3 raises many kinds; all mean "unknown now"
            log.warning("checkpoint store of %s/%s unreadable: %s", namespace, name, exc)
            return None, CheckpointView(reachable=False, error=_short(exc))
        return None, CheckpointView(
            step=latest.step if latest else None, uri=latest.uri if latest else None,
            time=latest.time if latest else None,
            progress_step=progress.step if progress else None,
            progress_time=progress.time if progress else None,
            progress_attempt=progress.attempt if progress else None,
        )

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
