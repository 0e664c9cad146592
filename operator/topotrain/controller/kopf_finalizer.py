"""kopf's finalizer on every TrainingJob, and the first pass's wait for it.

kopf starts a job's loop (its daemon) and writes its finalizer onto the job in the same step.
A first pass that runs before the watch shows that write decides from the version the write
replaced; its status write tests that version and is refused (409): a pass spent, planning
included, and about half a second, for every new job. The loop waits for the finalizer first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from topotrain import GROUP

FINALIZER = f"{GROUP}/finalizer"  # main.py's `configure` gives kopf this name
WAIT_SECONDS = 2.0


async def finalizer_shown(body: Mapping[str, Any], stopped: Any, limit: float = WAIT_SECONDS,
                          poll: float = 0.02) -> bool:
    """Wait, at most `limit` s, until `body` (kopf's live view of the job) shows kopf's finalizer
    or the job is being deleted (kopf adds none then). False when the wait ran out or the loop
    was stopped: the pass goes ahead, as it did before this wait."""
    deadline = time.monotonic() + limit
    while not stopped and time.monotonic() < deadline:
        meta = body.get("metadata") or {}
        if FINALIZER in (meta.get("finalizers") or ()) or meta.get("deletionTimestamp"):
            return True
        await asyncio.sleep(poll)
    return False
