"""The heartbeat: progress.json from rank 0, written on a thread (stdlib and boto3 only).

The operator reads it for hang detection (no step within progressTimeoutSeconds) and for the
recovery's phases (`AttemptStart`); a slow or failing store never stalls a training step.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

from topotrain_sdk.checkpoints import AttemptStart, CheckpointStore, ServedRequest
from topotrain_sdk.contract import CONTRACT_VERSION

log = logging.getLogger("topotrain_sdk.progress")


class Heartbeat:
    """Writes progress.json from rank 0 on a background thread; a slow S3 never stalls training."""

    def __init__(self, store: CheckpointStore, attempt: int) -> None:
        self.store, self.attempt = store, attempt
        self._thread: threading.Thread | None = None
        self.start: AttemptStart | None = None  # how this attempt started, sent with every beat
        self.request: ServedRequest | None = None  # the last checkpoint request served, likewise

    def first_step(self, step: int, process_start: datetime, load_seconds: float) -> None:
        """The attempt's first completed step: recorded, and reported at once."""
        self.start = AttemptStart(process_start, step, datetime.now(UTC), load_seconds)
        self.beat(step)

    def beat(self, step: int) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # the previous write is still retrying; skip this one
        start, request = self.start, self.request

        def write() -> None:
            try:
                self.store.write_progress(step, self.attempt, start=start, request=request,
                                          contract=CONTRACT_VERSION)
            except Exception as err:
                log.warning("progress heartbeat at step %d failed: %s", step, err)

        self._thread = threading.Thread(target=write, name="topotrain-heartbeat", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=60)
