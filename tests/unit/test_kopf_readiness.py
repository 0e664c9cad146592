"""kopf's start-up gate with topotrain.controller.kopf_readiness: the same waits, a wake-up only per change."""

from __future__ import annotations

import asyncio
from typing import Any

from kopf._cogs.aiokits import aiotoggles
from topotrain.controller import kopf_readiness


def test_the_gate_opens_once_every_object_is_indexed_and_wakes_waiters_only_then() -> None:
    assert kopf_readiness.install()
    assert kopf_readiness.install()  # idempotent

    async def run(objects: int) -> tuple[int, list[str]]:
        gate = aiotoggles.ToggleSet(all)
        wakeups = 0
        notify_all = gate._condition.notify_all

        def counted() -> None:
            nonlocal wakeups
            wakeups += 1
            notify_all()

        gate._condition.notify_all = counted  # type: ignore[method-assign]
        order: list[str] = []
        blocker = await gate.make_toggle(name="blocker")

        async def worker(toggle: Any, name: str) -> None:
            await asyncio.sleep(0)
            await gate.drop_toggle(toggle)  # indexed
            await gate.wait_for(True)  # every other object too
            order.append(name)

        tasks = []
        for i in range(objects):
            toggle = await gate.make_toggle(name=str(i))
            tasks.append(asyncio.create_task(worker(toggle, str(i))))
        while len(gate) > 1:
            await asyncio.sleep(0.001)
        assert not order, "nobody passes while the blocker holds the gate"
        await gate.drop_toggle(blocker)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        late = await gate.make_toggle(name="late")
        closed = gate.is_off()
        await gate.drop_toggle(late)
        return wakeups, [*order, f"closed again: {closed}"]

    wakeups, order = asyncio.run(run(300))
    assert len(order) == 301 and order[-1] == "closed again: True"
    assert wakeups <= 4, wakeups  # open, (re)close, open: not one per object
