"""Topology-aware gang placement for 3D-parallel jobs (pure: no Kubernetes client).

    from topotrain.placement import GangRequest, plan
    result = plan(GangRequest.from_spec(spec), Inventory.from_snapshot(nodes, pods))

`topology.py` builds the inventory the planner works on (pools, the topology tree, free
GPUs) from nodes and pods; `request.py` turns a spec into a gang and its mesh; `planner.py`
lists the planner's steps; `recovery.py` re-plans after failures and for shrinks;
`steptime.py` predicts the training step time a placement gives (docs/placement.md). This
package imports only `api` and the shared top-level modules, never `core`, `controller` or
`cli` (the import-linter contract in pyproject.toml).
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
