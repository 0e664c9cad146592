"""Gang planner: hard constraints, pool and data-degree choice, reasons, cost model."""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_placement_support import node, pod
from topotrain.placement import GangRequest, Mesh, plan
from topotrain.placement.cost import DomainIndex, evaluate
from topotrain.placement.topology import Inventory


def hgx(racks: list[int], *, free: int = 8, product: str = "H100-80GB", prefix: str = "n", blocks: int = 1) -> list[dict[str, Any]]:
    """Racks of 8-GPU nodes (each its own NVLink domain), `free` GPUs free on each."""
    out = []
    for r, count in enumerate(racks):
        for h in range(count):
            out.append(node(f"{prefix}{r}-{h}", free, block=f"b{r % blocks}", rack=f"{prefix}r{r}", product=product))
    return out


def nvl(cliques: list[int], *, rack_per_clique: bool = False) -> list[dict[str, Any]]:
    """4-GPU nodes grouped in multi-node NVLink cliques."""
    out = []
    for c, count in enumerate(cliques):
        rack = f"r{c}" if rack_per_clique else "r0"
        out += [node(f"c{c}-{h}", 4, rack=rack, clique=f"nvl{c}", product="GB200") for h in range(count)]
    return out


def req(**kw: Any) -> GangRequest:
    base: dict[str, Any] = {"tensor": 8, "pipeline": 1, "data": 1, "gpus_per_pod": 8}
    base.update(kw)
    return GangRequest(**base)


def inv(nodes: list[dict[str, Any]], pods: list[dict[str, Any]] | None = None) -> Inventory:
    return Inventory.from_snapshot(nodes, pods or [])


@pytest.mark.parametrize(
    ("nodes", "pods", "request_", "reason"),
    [
        (hgx([4]), [], req(data=5), "pool H100-80GB: 32 free GPUs in 4 nodes, need 40 (5 pods x 8)"),
        (hgx([4]), [pod(f"n0-{i}", 4) for i in range(4)], req(data=2),
         "pool H100-80GB: 16 free GPUs in 4 nodes, need 16 (2 pods x 8); only 0 pods of 8 GPUs fit on whole nodes"),
        (nvl([3, 1]), [], req(tensor=8, data=2, gpus_per_pod=4),
         "pool GB200: NVLink domains hold only 1 tensor-parallel groups of 8 GPUs, need 2"),
        (nvl([3, 3]), [], req(tensor=16, data=1, gpus_per_pod=4),
         "pool GB200: no NVLink domain has 16 free GPUs for a tensor-parallel group of 16 (largest: 12 in 4-GPU pods)"),
        (hgx([3, 3]), [], req(pipeline=4, data=1, pipeline_topology="Required"),
         "pool H100-80GB: topology.pipeline=Required keeps each pipeline group (4 pods, 32 GPUs) inside one rack; "
         "the largest rack has room for 3 pods"),
        (hgx([4, 3, 1]), [], req(pipeline=4, data=2, pipeline_topology="Required"),
         "pool H100-80GB: racks fit only 1 of 2 pipeline groups (4 pods each) under topology.pipeline=Required"),
        (hgx([2, 1, 1]), [], req(pipeline=2, data=2, data_topology="Required"),
         "pool H100-80GB: racks fit only 1 of 2 data groups (2 pods each) under topology.data=Required"),
        (hgx([4]), [], req(data=1, gpu_types=("B200",)),
         "pool B200: no usable node (Ready, schedulable, tolerated, matching nodeSelector)"),
    ],
)
def test_infeasible_reasons(
    nodes: list[dict[str, Any]], pods: list[dict[str, Any]], request_: GangRequest, reason: str
) -> None:
    result = plan(request_, inv(nodes, pods))
    assert not result.feasible
    assert result.reason == reason
    assert result.assignments == ()


def _check_constraints(result: Any, request_: GangRequest, inventory: Inventory) -> None:
    assert result.feasible, result.reason
    mesh = Mesh.build(request_, result.data)
    used: dict[str, int] = {}
    for a in result.assignments:
        used[a.node] = used.get(a.node, 0) + request_.gpus_per_pod
    assert all(gpus <= inventory.nodes[n].free for n, gpus in used.items())
    for unit in mesh.tp_units:
        assert len({inventory.nodes[result.nodes[p]].nvlink for p in unit}) == 1
    for group in mesh.rack_units:
        assert len({inventory.nodes[result.nodes[p]].rack for p in group}) == 1


@pytest.mark.parametrize(
    ("nodes", "request_"),
    [
        (nvl([4, 2, 3]), req(tensor=8, pipeline=2, data=2, gpus_per_pod=4)),  # TP groups span 2 pods
        (nvl([5, 4]), req(tensor=16, pipeline=1, data=2, gpus_per_pod=4)),  # 4-pod TP groups
        (hgx([3, 4, 4]), req(pipeline=4, data=2, pipeline_topology="Required")),
        (hgx([3, 3, 2]), req(pipeline=2, data=3, data_topology="Required")),
        (hgx([5, 5]), req(tensor=4, pipeline=4, data=2, gpus_per_pod=4)),  # two 4-GPU pods may share a node
        (hgx([4, 4]), req(tensor=2, pipeline=3, data=2, gpus_per_pod=4, rank_order="tp-dp-pp")),
    ],
)
def test_hard_constraints_hold(nodes: list[dict[str, Any]], request_: GangRequest) -> None:
    inventory = inv(nodes)
    result = plan(request_, inventory)
    _check_constraints(result, request_, inventory)
    assert [a.index for a in result.assignments] == list(range(request_.pods()))
    g = request_.gpus_per_pod
    assert [a.ranks for a in result.assignments] == [(i * g, i * g + g - 1) for i in range(request_.pods())]


def test_tensor_preferred_splits_groups_only_when_it_must() -> None:
    tight = nvl([3, 1])
    strict = plan(req(tensor=8, data=2, gpus_per_pod=4), inv(tight))
    loose = plan(req(tensor=8, data=2, gpus_per_pod=4, tensor_topology="Preferred"), inv(tight))
    assert not strict.feasible and loose.feasible
    assert "tensor groups split" in loose.strategy
    roomy = plan(req(tensor=8, data=2, gpus_per_pod=4, tensor_topology="Preferred"), inv(nvl([2, 2])))
    assert "split" not in roomy.strategy


@pytest.mark.parametrize(
    ("pools", "gpu_types", "data", "min_data", "pool", "degree"),
    [
        ({"A100": 4, "H100": 4}, ("H100", "A100"), 4, 4, "H100", 4),  # first fits: first wins
        ({"A100": 4, "H100": 2}, ("H100", "A100"), 4, 1, "A100", 4),  # first is short: the one fitting full data
        ({"A100": 3, "H100": 2}, ("H100", "A100"), 4, 1, "A100", 3),  # none fits full: the largest degree
        ({"A100": 2, "H100": 2}, ("H100", "A100"), 4, 1, "H100", 2),  # tie: preference order
        ({"A100": 8, "H100": 1}, ("H100",), 4, 1, "H100", 1),  # only listed pools
        ({"A100": 2, "H100": 3}, (), 4, 1, "H100", 3),  # no preference: any pool
    ],
)
def test_pool_and_data_degree(
    pools: dict[str, int], gpu_types: tuple[str, ...], data: int, min_data: int, pool: str, degree: int
) -> None:
    nodes = [n for name, count in pools.items() for n in hgx([count], product=name, prefix=name.lower())]
    result = plan(req(data=data, min_data=min_data, gpu_types=gpu_types), inv(nodes))
    assert (result.pool, result.data) == (pool, degree)
    assert result.parallelism == {"tensor": 8, "pipeline": 1, "data": degree}


def test_data_degree_skips_degrees_without_whole_pods() -> None:
    result = plan(req(tensor=1, data=5, min_data=3, gpus_per_pod=2), inv(hgx([1], free=8)))
    assert result.data == 4  # 5 GPUs is not whole 2-GPU pods; 4 is the largest that fits


def test_elastic_job_below_min_data_is_infeasible() -> None:
    result = plan(req(data=4, min_data=3), inv(hgx([2])))
    assert not result.feasible
    assert result.reason == "pool H100-80GB: 16 free GPUs in 2 nodes, need 24 (3 pods x 8)"  # at minData


def test_cost_model_by_hand() -> None:
    """tp8 pp2 dp2, one pod per stage, replicas in two racks of one block."""
    nodes = inv(hgx([2, 2])).pools()["H100-80GB"]
    index = DomainIndex(nodes)
    mesh = Mesh.build(req(pipeline=2, data=2))
    cost = evaluate(mesh, index, [0, 1, 2, 3])  # replica 0 on rack 0, replica 1 on rack 1
    # pipeline pairs (0,1), (2,3): 8 rank pairs each, NVLink level only -> 16
    # data groups {0,2}, {1,3}: 8 each, span 2 NVLink domains (1) and 2 racks (4) -> 2*8*(1+4) = 80
    assert (cost.nvlink, cost.rack, cost.block, cost.pipeline, cost.data) == (32, 64, 0, 16, 80)
    assert cost.total == 96


def test_prefers_one_rack_and_one_block() -> None:
    nodes = hgx([3, 4, 8], blocks=2)  # racks 0 and 2 in block b0, rack 1 in b1
    result = plan(req(pipeline=4, data=2), inv(nodes))
    racks = {inv(nodes).nodes[n].rack for n in result.nodes.values()}
    assert racks == {("b0", "nr2")} and result.cost.rack == result.cost.block == 0


def test_beats_rank_order_filling_when_the_job_spans_racks() -> None:
    """Replica-per-rack costs 392 here (every data group spans three racks); placing
    stage blocks across racks is cheaper, and the planner finds it."""
    nodes = hgx([4, 4, 4])
    request_ = req(pipeline=4, data=3)
    result = plan(request_, inv(nodes))
    index = DomainIndex(inv(nodes).pools()["H100-80GB"])
    replica_per_rack = evaluate(Mesh.build(request_), index, list(range(12)))
    assert replica_per_rack.total == 392
    assert result.cost.total < replica_per_rack.total
    assert result.cost.block == 0


def test_deterministic_and_independent_of_snapshot_order() -> None:
    nodes = hgx([5, 6, 7], blocks=2)
    pods = [pod("n0-1", 8), pod("n2-3", 4)]
    request_ = req(pipeline=4, data=3)
    first = plan(request_, inv(nodes, pods))
    shuffled = list(nodes)
    random.Random(3).shuffle(shuffled)
    assert plan(request_, inv(shuffled, pods)) == first == plan(request_, inv(nodes, pods))


def test_json_document() -> None:
    result = plan(req(pipeline=2, data=1), inv(hgx([2])))
    doc = result.to_json()
    assert set(doc) == {"feasible", "reason", "pool", "parallelism", "pods", "cost"}
    assert doc["pods"] == [{"index": 0, "node": "n0-0", "ranks": [0, 7]}, {"index": 1, "node": "n0-1", "ranks": [8, 15]}]
    assert doc["cost"]["total"] == 8 and doc["reason"] is None
    assert plan(req(data=9), inv(hgx([2]))).to_json()["parallelism"] is None


def test_request_from_the_api_model() -> None:
    from topotrain.api.spec import TrainingJobSpec

    spec = TrainingJobSpec.model_validate({
        "image": "t:1",
        "parallelism": {"tensor": 4, "pipeline": 2, "data": 8, "minData": 2},
        "rankOrder": "tp-dp-pp",
        "worker": {"gpusPerPod": 8, "gpuTypes": ["H100-80GB", "A100-80GB"]},
        "topology": {"pipeline": "Required"},
    })
    assert GangRequest.from_spec(spec) == GangRequest(
        tensor=4, pipeline=2, data=8, min_data=2, gpus_per_pod=8, gpu_types=("H100-80GB", "A100-80GB"),
        rank_order="tp-dp-pp", tensor_topology="Required", pipeline_topology="Required", data_topology="Preferred",
    )


def test_reserved_gpus_keep_two_jobs_apart() -> None:
    nodes = hgx([4, 4])
    first = plan(req(pipeline=2, data=2), inv(nodes))
    taken = {node: 8 for node in first.nodes.values()}
    second = plan(req(pipeline=2, data=2), Inventory.from_snapshot(nodes, [], reserved=taken))
    assert second.feasible and not set(second.nodes.values()) & set(first.nodes.values())
    assert not plan(req(pipeline=2, data=3), Inventory.from_snapshot(nodes, [], reserved=taken)).feasible


def test_the_shortfall_of_a_huge_gang_is_reported_without_enumerating_its_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """65536 ranks (the API's cap) on 4 nodes: the reason is arithmetic, no mesh is built."""

    def no_mesh(*_: Any, **__: Any) -> Mesh:
        raise AssertionError("built the mesh of a gang that cannot fit")

    monkeypatch.setattr(Mesh, "build", no_mesh)
    result = plan(req(tensor=8, pipeline=8, data=1024, min_data=512), inv(hgx([4])))
    assert not result.feasible
    assert "32 free GPUs in 4 nodes, need 32768 (4096 pods x 8)" in result.reason
