"""The planner against a brute-force optimum of the cost model on small instances
(at most 8 usable nodes, at most 8 pods): equal on at least 95%, never more than 10% above."""

from __future__ import annotations

import random

from test_placement_support import brute_force, cost_of, random_cluster, random_request
from topotrain.placement import Mesh, plan
from topotrain.placement.cost import DomainIndex
from topotrain.placement.topology import Inventory

INSTANCES = 250


def test_close_to_the_optimum_on_small_instances() -> None:
    equal = compared = 0
    worst = 1.0
    for seed in range(INSTANCES):
        rng = random.Random(seed)
        nodes = random_cluster(rng, max_nodes=8)
        request = random_request(rng, max_pods=8)
        inventory = Inventory.from_snapshot(nodes, [])
        mesh = Mesh.build(request)
        index = DomainIndex(inventory.pools()["H100-80GB"])
        optimum = brute_force(mesh, index)
        result = plan(request, inventory)
        if optimum is None:
            assert not result.feasible, f"seed {seed}: planner found a plan brute force did not"
            continue
        assert result.feasible, f"seed {seed}: a plan of cost {optimum} exists; planner said {result.reason}"
        cost = cost_of(mesh, index, result.nodes)
        compared += 1
        equal += cost == optimum
        worst = max(worst, cost / optimum if optimum else (1.0 if cost == 0 else float("inf")))
    assert compared >= INSTANCES * 0.8
    assert equal >= 0.95 * compared, f"optimal on {equal} of {compared}"
    assert worst <= 1.10, f"worst ratio {worst:.3f}"
