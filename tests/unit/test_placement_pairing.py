"""The planner's last step (placement/pairing.py): on a pool whose NVLink domains hold two
8-GPU nodes, which of a gang's neighbours share a domain, decided by the step-time model
where the cost model ties."""

from __future__ import annotations

from typing import Any

from test_placement import inv, req
from test_placement_support import node, pod
from topotrain.placement import Mesh, plan
from topotrain.placement.cost import DomainIndex, evaluate
from topotrain.placement.pairing import faster_pairing, stage_paired
from topotrain.placement.steptime import predict
from topotrain.placement.steptime_tables import Workload


def paired_rack(nodes: int, rack: str = "r0") -> list[dict[str, Any]]:
    """One rack of H100 nodes, two a NVLink domain (HGX boards on one NVLink switch)."""
    return [node(f"{rack}-n{i}", rack=rack, clique=f"{rack}-d{i // 2}") for i in range(nodes)]


def _placed(request_kw: dict[str, int], nodes: list[dict[str, Any]],
            pods: list[dict[str, Any]] | None = None) -> tuple[Mesh, DomainIndex, list[int]]:  # fmt: skip
    inventory = inv(nodes, pods)
    result = plan(req(**request_kw), inventory)
    assert result.feasible, result.reason
    index = DomainIndex(inventory.pools()["H100-80GB"])
    at = {name: i for i, name in enumerate(index.names)}
    mesh = Mesh.build(req(**request_kw), result.parallelism["data"] if result.parallelism else None)
    return mesh, index, [at[a.node] for a in sorted(result.assignments, key=lambda a: a.index)]


def _step(mesh: Mesh, index: DomainIndex, assign: list[int], model: str = "8B", microbatches: int = 16) -> float:
    workload = Workload(model, 4096, microbatches * mesh.request.data, 1)
    return predict(mesh, index, assign, workload, "H100-80GB").total


def test_the_same_stage_of_two_replicas_shares_a_domain_when_their_gradients_outweigh_the_pipeline() -> None:
    """tp8 pp2 dp2 on four nodes in two domains: pipeline pairs or data pairs in a domain cost
    the same; the gradient ring moves far more bytes than a micro-batch's activations, so each
    stage's two replicas share a domain and the pipeline hop goes through the rack's switch."""
    mesh, index, assign = _placed({"pipeline": 2, "data": 2}, paired_rack(4))
    # pods in rank order: (stage 0, replica 0), (stage 1, replica 0), (stage 0, 1), (stage 1, 1)
    assert index.clique[assign[0]] == index.clique[assign[2]] and index.clique[assign[1]] == index.clique[assign[3]]
    by_replica = sorted(assign, key=lambda n: (index.clique[n], n))  # pods 0, 1 in one domain
    assert evaluate(mesh, index, assign).total == evaluate(mesh, index, by_replica).total
    for model, microbatches in (("8B", 16), ("70B", 1)):
        assert _step(mesh, index, assign, model, microbatches) < _step(mesh, index, by_replica, model, microbatches)
    assert predict(mesh, index, assign, Workload("8B", 4096, 32, 1), "H100-80GB").levels["data"] == "nvlink"
    # `topotrain plan` prints the strategy: it says the domains were refilled, and how
    assert plan(req(pipeline=2, data=2), inv(paired_rack(4))).strategy.endswith("+domains stage-major")


def test_pipeline_neighbours_keep_a_domain_when_a_stages_replicas_cannot_share_one() -> None:
    """tp8 pp2 dp4: a stage's four replicas never fit one two-node domain, so their ring runs
    at the rack's speed either way; the pipeline pairs keep their domains."""
    mesh, index, assign = _placed({"pipeline": 2, "data": 4}, paired_rack(8))
    assert all(index.clique[assign[2 * r]] == index.clique[assign[2 * r + 1]] for r in range(4))
    assert faster_pairing(mesh, index, assign) is None


def test_the_filling_keeps_each_racks_pods_so_no_rack_or_block_crossing_changes() -> None:
    """Two racks, the gang spread over both by a fragmented fleet: the stage-major filling
    moves pods only among the nodes of their own rack."""
    nodes = paired_rack(4, "ra") + paired_rack(4, "rb")
    busy = [pod("ra-n2", 8), pod("ra-n3", 8), pod("rb-n0", 8), pod("rb-n1", 8)]
    mesh, index, assign = _placed({"pipeline": 2, "data": 2}, nodes, busy)
    paired = stage_paired(mesh, index, assign)
    assert paired is not None and sorted(paired) == sorted(assign)
    assert all(index.rack[a] == index.rack[b] for a, b in zip(assign, paired, strict=True))
    before, after = evaluate(mesh, index, assign), evaluate(mesh, index, paired)
    assert (before.rack, before.block) == (after.rack, after.block) and before.rack > 0


def test_nodes_each_their_own_domain_are_filled_as_before() -> None:
    """A100-style pools (one node a domain): nothing to pair, the plan is the cost model's."""
    nodes = [node(f"n{i}") for i in range(4)]
    mesh, index, assign = _placed({"pipeline": 2, "data": 2}, nodes)
    assert faster_pairing(mesh, index, assign) is None


def test_a_mixed_filling_the_search_ties_on_is_refilled_in_rank_order() -> None:
    """tp8 pp2 dp3 on six nodes in three domains (bench/versus.py's dense-029): two replicas'
    stages paired by stage and the third by replica costs what rank order costs (32), but two
    pipeline hops go through the rack's switch; rank order keeps every pipeline pair in a
    domain, and a stage's ring of three is at the rack's speed either way."""
    inventory = inv(paired_rack(6))
    index = DomainIndex(inventory.pools()["H100-80GB"])
    n = {name: i for i, name in enumerate(index.names)}
    mesh = Mesh.build(req(pipeline=2, data=3))  # pods: s0r0, s1r0, s0r1, s1r1, s0r2, s1r2
    mixed = [n["r0-n0"], n["r0-n2"], n["r0-n1"], n["r0-n3"], n["r0-n4"], n["r0-n5"]]
    found = faster_pairing(mesh, index, mixed)
    assert found is not None and found[1] == "rank-order"
    refilled = found[0]
    assert refilled == [n[f"r0-n{i}"] for i in range(6)]
    assert evaluate(mesh, index, refilled).total == evaluate(mesh, index, mixed).total == 32
    assert _step(mesh, index, refilled) < _step(mesh, index, mixed)
    _, _, planned = _placed({"pipeline": 2, "data": 3}, paired_rack(6))
    assert all(index.clique[planned[2 * r]] == index.clique[planned[2 * r + 1]] for r in range(3))
