"""Topology-aware gang placement for 3D-parallel jobs (pure: no Kubernetes client).

    from topotrain.placement import GangRequest, plan
    result = plan(GangRequest.from_spec(spec), Inventory.from_snapshot(nodes, pods))
"""

from topotrain.placement.cost import LEVELS, WEIGHTS, Cost, DomainIndex, evaluate
from topotrain.placement.model import Fragmentation, Plan, PodAssignment
from topotrain.placement.planner import meets_constraints, plan
from topotrain.placement.recovery import RecoveryPlan, plan_shrink, replan_recovery
from topotrain.placement.request import GangRequest, Mesh, RequestError

__all__ = [
    "LEVELS", "WEIGHTS", "Cost", "DomainIndex", "Fragmentation", "GangRequest", "Mesh", "Plan",
    "PodAssignment", "RecoveryPlan", "RequestError", "evaluate", "meets_constraints", "plan",
    "plan_shrink", "replan_recovery",
]
