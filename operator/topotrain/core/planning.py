"""The planner as the reconciler sees it: a narrow Protocol and its result.

`reconcile` asks a `Planner` bound to one job and one snapshot of the cluster
(in which the job's own pods hold nothing, since every restart replaces the
whole gang). The real one wraps `topotrain.placement` (`PlacementPlanner`, below); unit tests pass a table-driven fake.
The operator's loop plans through two adapters (at the end): `WithinAssignment` (Kueue's assigned
nodes only) and `LazyPlanner` (builds the inventory only when the reconciler asks for a plan).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from topotrain import degrees, placement
from topotrain.api.spec import TrainingJobSpec
from topotrain.api.status import Reason
from topotrain.placement import GangRequest
from topotrain.placement.topology import Inventory

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


class PlacementPlanner:
    """The `Planner` backed by `topotrain.placement`, for one job and one inventory.

    Build the inventory without the job's own pods (`ignore_pods_of`), since a
    restart replaces the whole gang, and with the GPUs of pods created but not
    yet bound reserved, so two plans never double-book a node.
    """

    def __init__(self, spec: TrainingJobSpec, inventory: Inventory) -> None:
        self.request = GangRequest.from_spec(spec)
        self.inventory = inventory

    def _request(self, low: int, high: int) -> GangRequest:
        return replace(self.request, data=high, min_data=min(low, high))

    def plan(self, low: int, high: int) -> PlanOutcome:
        unknown = self._unknown_pools() or self._no_allowed_degree(low, high)
        if unknown is not None:
            return unknown
        return self._outcome(placement.plan(self._request(low, high), self.inventory), "initial")

    def replan(
        self, previous: Mapping[int, str], lost: frozenset[str], low: int, high: int
    ) -> PlanOutcome:
        request = self._request(low, high)
        if not request.allows(high) or not request.whole_replicas(len(previous)):
            # running at a degree the rule forbids, or no record of where part of a replica
            # ran: start afresh
            return replace(self.plan(low, high), mode="full")
        recovery = placement.replan_recovery(request, self.inventory, previous, lost)
        if recovery.feasible:
            return self._outcome(recovery.plan, recovery.mode)
        for data in range(high - 1, low - 1, -1):  # shrink, keeping the healthiest replicas
            if not request.allows(data):
                continue
            shrunk = placement.plan_shrink(request, self.inventory, previous, lost, data)
            if shrunk.feasible:
                return self._outcome(shrunk.plan, shrunk.mode)
        return self._outcome(recovery.plan, "full")

    def _unknown_pools(self) -> PlanOutcome | None:
        wanted = self.request.gpu_types
        known = {info.pool for info in self.inventory.known.values()}
        if not wanted or known & set(wanted):
            return None
        return PlanOutcome(
            False, reason=Reason.UNKNOWN_GPU_TYPE,
            message=f"no node in the cluster has GPU type {', '.join(wanted)} "
            f"(known: {', '.join(sorted(known)) or 'none'}); fix spec.worker.gpuTypes",
        )

    def _no_allowed_degree(self, low: int, high: int) -> PlanOutcome | None:
        """No degree in [low, high] can ever run (topotrain.degrees): say so, naming the rule."""
        rule = self.request.rule
        if rule.degrees(low, high):
            return None
        return PlanOutcome(False, reason=degrees.REASON, message=rule.explain(low, high))

    def _outcome(self, result: placement.Plan, mode: str) -> PlanOutcome:
        if not result.feasible:
            return PlanOutcome(
                False, reason=Reason.INSUFFICIENT_CAPACITY, message=result.reason or "no placement",
                mode=mode,
            )
        nodes = result.nodes
        paths = [self._path(n) for n in set(nodes.values())]
        return PlanOutcome(
            True, pool=result.pool, data=result.data or 0, assignments=nodes,
            cost=float(result.cost.total), mode=mode, nodes=len(paths),
            racks=len({p[:2] for p in paths}), blocks=len({p[:1] for p in paths}),
        )

    def _path(self, node: str) -> tuple[str, ...]:
        info = self.inventory.nodes.get(node) or self.inventory.known.get(node)
        return (node, node) if info is None else tuple(info.path)


# --- adapters the operator's loop plans through (controller/loop.py) -----------------------


class WithinAssignment:
    """Plans on Kueue's topology assignment only (`planner`: on the inventory cut down to it,
    kueue_admission.within_assignment), never on the admitted flavor's other nodes: Kueue may have
    promised those to admitted workloads whose pods do not exist yet, and a gang placed there would
    take them. `lost`: the assigned nodes the gang can no longer use, and why
    (kueue_admission.lost_assigned).

    When the gang does not fit and a node of the assignment is lost, the outcome says so (reason
    HandedBackToKueue): the reconciler gives the job back to Kueue for a new assignment. When it
    does not fit on healthy assigned nodes (their GPUs still held by pods on their way out), it
    waits for room there.
    """

    def __init__(self, planner: Planner, lost: Mapping[str, str]) -> None:
        self.planner, self.lost = planner, dict(lost)

    def plan(self, low: int, high: int) -> PlanOutcome:
        return self._said(self.planner.plan(low, high))

    def replan(self, previous: Mapping[int, str], lost: frozenset[str], low: int, high: int
               ) -> PlanOutcome:
        return self._said(self.planner.replan(previous, lost | frozenset(self.lost), low, high))

    def _said(self, outcome: PlanOutcome) -> PlanOutcome:
        if outcome.feasible:
            return outcome
        if not self.lost:
            return replace(outcome, message=f"waiting for room on the nodes of Kueue's topology "
                           f"assignment: {outcome.message}")
        nodes = ", ".join(f"{name} ({why})" for name, why in sorted(self.lost.items()))
        one = len(self.lost) == 1
        return replace(outcome, reason=Reason.HANDED_BACK, message=(
            f"{'node' if one else 'nodes'} {nodes} of Kueue's topology assignment "
            f"{'is' if one else 'are'} lost and the gang does not fit on the rest: handed back to "
            "Kueue for a new topology assignment"))


class WouldPlan(Exception):
    """A decision made without the plan lock asked for a plan: it is made under the lock instead
    (planning it first without the lock too doubled the CPU a launch costs; at 5,000 nodes a
    plan takes a few hundred milliseconds, and launches queue for the lock)."""


class LazyPlanner:
    """Builds the inventory only when the reconciler actually asks for a plan; with `probe`,
    raises WouldPlan instead of planning."""

    def __init__(self, make: Callable[[], Planner], probe: bool = False) -> None:
        self._make, self._probe = make, probe
        self._planner: Planner | None = None

    @property
    def used(self) -> bool:
        """The reconciler asked for a plan (its inventory was built)."""
        return self._planner is not None

    def _get(self) -> Planner:
        if self._probe:
            raise WouldPlan
        if self._planner is None:
            self._planner = self._make()
        return self._planner

    def plan(self, low: int, high: int) -> PlanOutcome:
        return self._get().plan(low, high)

    def replan(self, previous: Mapping[int, str], lost: frozenset[str], low: int, high: int
               ) -> PlanOutcome:
        return self._get().replan(previous, lost, low, high)
