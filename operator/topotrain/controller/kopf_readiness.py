"""kopf's start-up gate without a wake-up of every waiting object per listed object.

Until every index is filled, kopf holds each watched object's worker at one gate: a set of
toggles (`aiotoggles.ToggleSet(all)`), one per listed object of an indexed resource, dropped when
that object is indexed; every other worker waits for the whole set. kopf 1.45 wakes every
waiting worker each time a toggle is added or dropped, so listing N objects costs about N^2
wake-ups: with 5,000 nodes the operator spent minutes of CPU in `Condition.notify_all` before its
first watch began (py-spy, bench/scale.py), and its liveness endpoint shared that event loop.

`install` makes adding and dropping a toggle wake the waiters only when the set's state changes
(off -> on, or on -> off), which is all that they wait for. A toggle turned on or off still wakes
them as before. Nothing else changes; a kopf without these internals is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("topotrain")


def install() -> bool:
    """Patch kopf's ToggleSet (idempotent). False when this kopf does not look as expected."""
    try:
        from kopf._cogs.aiokits import aiotoggles
    except ImportError:
        return False
    toggle_set: Any = aiotoggles.ToggleSet
    if getattr(toggle_set, "_topotrain_quiet", False):
        return True
    if not all(hasattr(toggle_set, name) for name in ("make_toggle", "drop_toggle", "drop_toggles", "is_on")):
        log.warning("kopf's ToggleSet is not as expected: its start-up gate is left as it is")
        return False

    async def make_toggle(self: Any, __val: bool = False, *, name: str | None = None) -> Any:
        toggle = aiotoggles.Toggle(__val, name=name, condition=self._condition)
        async with self._condition:
            before = self.is_on()
            self._toggles.add(toggle)
            if self.is_on() != before:
                self._condition.notify_all()
        return toggle

    async def drop_toggle(self: Any, toggle: Any) -> None:
        async with self._condition:
            before = self.is_on()
            self._toggles.discard(toggle)
            if self.is_on() != before:
                self._condition.notify_all()

    async def drop_toggles(self: Any, toggles: Iterable[Any]) -> None:
        async with self._condition:
            before = self.is_on()
            self._toggles.difference_update(toggles)
            if self.is_on() != before:
                self._condition.notify_all()

    toggle_set.make_toggle, toggle_set.drop_toggle = make_toggle, drop_toggle
    toggle_set.drop_toggles, toggle_set._topotrain_quiet = drop_toggles, True
    return True
