"""The planner as the reconciler sees it: a narrow Protocol and its result.

`reconcile` asks a `Planner` bound to one job and one snapshot of the cluster
(in which the job's own pods hold nothing, since every restart replaces the
whole gang). The real one wraps `topotrain.placement` (see
`handlers_plan.py`); unit tests pass a table-driven fake.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

PlanMode = str  # "initial", "incremental" or "full"


@dataclass(frozen=True)
class PlanOutcome:
    """A gang placement, or why there is none."""

    feasible: bool
    reason: str = ""  # a status.Reason when infeasible
    message: str = ""
    pool: str | None = None
    data: int = 0
    assignments: Mapping[int, str] = field(default_factory=dict)  # pod index -> node
    cost: float = 0.0
    mode: PlanMode = "initial"
    nodes: int = 0
    racks: int = 0
    blocks: int = 0


class Planner(Protocol):
    """Places one job's gang on one snapshot of the cluster."""

    def plan(self, low: int, high: int) -> PlanOutcome:
        """A fresh plan with the largest feasible data degree in [low, high]."""
        ...

    def replan(
        self, previous: Mapping[int, str], lost: frozenset[str], low: int, high: int
    ) -> PlanOutcome:
        """Recovery: keep `previous` pods on healthy nodes, replace those on `lost` nodes.

        Falls back to a full plan (mode "full"), possibly with a smaller data
        degree in [low, high], when the lost pods cannot be replaced in place.
        """
        ...
