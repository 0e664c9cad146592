"""Property tests on random clusters: every plan keeps capacity and every hard constraint,
never costs more than the BestFit-like baseline, and the same input gives the same plan."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_placement_support import pod, random_cluster, random_request
from topotrain.placement import GangRequest, Mesh, evaluate, meets_constraints, plan
from topotrain.placement.baselines import bestfit_assign
from topotrain.placement.cost import DomainIndex
from topotrain.placement.topology import Inventory


@st.composite
def instances(draw: st.DrawFn) -> tuple[Inventory, GangRequest]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    nodes = random_cluster(rng, max_nodes=draw(st.integers(2, 24)))
    pods = [pod(f"n{rng.randrange(len(nodes))}", rng.choice([1, 2, 4])) for _ in range(draw(st.integers(0, 6)))]
    request = random_request(rng, max_pods=draw(st.integers(2, 16)))
    if draw(st.booleans()):
        request = replace(request, min_data=1)
    request = replace(
        request,
        pipeline_topology=draw(st.sampled_from(["Preferred", "Preferred", "Required"])),
        data_topology=draw(st.sampled_from(["Preferred", "Preferred", "Required"])),
    )
    return Inventory.from_snapshot(nodes, pods), request


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_plans_keep_capacity_and_constraints(instance: tuple[Inventory, GangRequest]) -> None:
    inventory, request = instance
    result = plan(request, inventory)
    if not result.feasible:
        assert result.reason and result.assignments == ()
        return
    assert result.data is not None and request.lowest_data <= result.data <= request.data
    mesh = Mesh.build(request, result.data)
    assert sorted(result.nodes) == list(range(mesh.pods))  # all or nothing
    used: dict[str, int] = {}
    for a in result.assignments:
        used[a.node] = used.get(a.node, 0) + request.gpus_per_pod
        assert inventory.nodes[a.node].pool == result.pool
    assert all(gpus <= inventory.nodes[n].free for n, gpus in used.items())
    index = DomainIndex(inventory.pools()[result.pool or ""])
    position = {name: i for i, name in enumerate(index.names)}
    assign = [position[result.nodes[i]] for i in range(mesh.pods)]
    assert meets_constraints(mesh, index, assign)
    assert evaluate(mesh, index, assign) == result.cost
    baseline = bestfit_assign(mesh, index)
    if baseline is not None and meets_constraints(mesh, index, baseline):
        assert result.cost.total <= evaluate(mesh, index, baseline).total


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_same_input_same_plan(instance: tuple[Inventory, GangRequest]) -> None:
    inventory, request = instance
    assert plan(request, inventory) == plan(request, inventory)
