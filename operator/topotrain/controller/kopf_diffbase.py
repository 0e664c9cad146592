"""kopf's diff base, built for nothing: topotrain registers no change handler.

For every watch event of every watched object (pods and nodes included: thousands of events a
minute at 5,000 nodes), kopf builds the object's "essence" (a deep copy of its body, less the
system fields) and diffs it against the last handled one. Only change handlers (`kopf.on.create`,
`update`, `delete`, `resume`, `field`) read that diff, and their storage; topotrain's handlers are
event, index and daemon handlers (main.py), which never do (the daemons' idle timers read
whether the diff is empty: none of ours has one). Profiled at 5,000 nodes (docs/benchmarks.md,
session 14) the essence was about 8 % of the event loop's thread.

`EmptyDiffBase` builds and stores nothing; `change_handlers()` lists what would need it, and the
operator refuses to start with any (`main.configure`), so a change handler added later cannot
silently see empty diffs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf


class EmptyDiffBase(kopf.DiffBaseStorage):
    def build(self, *, body: Any, extra_fields: Iterable[Any] | None = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> Any:
        return {}  # the same as build: an empty diff, no idle reset

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


def change_handlers(registry: Any = None) -> list[str]:
    """The ids of the change handlers registered with kopf (none expected)."""
    registry = registry or kopf.get_default_registry()
    return [str(h.id) for h in registry._changing.get_all_handlers()]
