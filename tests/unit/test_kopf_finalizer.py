"""The first pass's wait for kopf's finalizer (controller/kopf_finalizer.py), on a plain dict
standing in for kopf's live view of the job (a unit-test boundary: kopf replaces that view's
content in place as watch events arrive, as the task below does)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from topotrain.controller.kopf_finalizer import FINALIZER, finalizer_shown


def test_the_wait_ends_when_the_watch_shows_the_finalizer() -> None:
    body: dict[str, Any] = {"metadata": {"name": "llm", "finalizers": ["other.io/keep"]}}

    async def scenario() -> tuple[bool, float]:
        async def kopf_writes() -> None:
            await asyncio.sleep(0.2)
            body["metadata"] = {**body["metadata"], "finalizers": ["other.io/keep", FINALIZER]}

        writer = asyncio.create_task(kopf_writes())
        began = time.monotonic()
        shown = await finalizer_shown(body, False, limit=30.0)
        await writer
        return shown, time.monotonic() - began

    shown, waited = asyncio.run(scenario())
    assert shown and 0.2 <= waited < 30.0


def test_a_job_being_deleted_or_never_finalized_is_not_waited_for_long() -> None:
    deleting = {"metadata": {"deletionTimestamp": "2026-12-07T00:00:00Z"}}
    assert asyncio.run(finalizer_shown(deleting, False, limit=30.0))
    began = time.monotonic()
    assert not asyncio.run(finalizer_shown({"metadata": {}}, False, limit=0.3))
    assert time.monotonic() - began >= 0.3  # the pass then goes ahead, as before the wait
    assert not asyncio.run(finalizer_shown({"metadata": {}}, True, limit=30.0))  # a stopped loop
