"""Recovery re-plans: keep healthy pods, replace lost ones nearby, else re-plan or shrink."""

from __future__ import annotations

from typing import Any

from test_placement import hgx, inv, req
from test_placement_support import node
from topotrain.placement import plan, plan_shrink, replan_recovery


def running(nodes: list[dict[str, Any]], request_: Any) -> dict[int, str]:
    result = plan(request_, inv(nodes))
    assert result.feasible
    return result.nodes


def test_only_the_lost_pod_moves_and_it_stays_in_its_rack() -> None:
    nodes = hgx([2, 4])  # replica 0 on rack 0, replica 1 on rack 1, which has two spare nodes
    current = {0: "n0-0", 1: "n0-1", 2: "n1-0", 3: "n1-1"}
    nodes.append(node("n0-9", rack="nr0"))  # one spare in rack 0
    result = replan_recovery(req(pipeline=2, data=2), inv(nodes), current, {"n0-1"})
    assert result.mode == "incremental" and result.feasible
    assert result.moved == (1,)
    assert result.plan.nodes == {**current, 1: "n0-9"}  # same rack as the lost node, not rack 1
    assert result.kept == (0, 2, 3)


def test_replacement_prefers_the_lost_nodes_nvlink_domain_then_rack() -> None:
    nodes = [node(f"a{i}", 4, rack="r0", clique="A", product="GB200") for i in range(4)]
    nodes += [node(f"b{i}", 4, rack="r0", clique="B", product="GB200") for i in range(4)]
    nodes += [node(f"c{i}", 4, rack="r1", clique="C", product="GB200") for i in range(4)]
    request_ = req(tensor=4, pipeline=2, data=1, gpus_per_pod=4)
    current = {0: "a0", 1: "b0"}
    same_domain = replan_recovery(request_, inv(nodes), current, {"a0"})
    assert same_domain.plan.nodes[0].startswith("a") and same_domain.moved == (0,)
    full_a = [n for n in nodes if n["metadata"]["name"] != "a0"]
    for n in full_a:
        if n["metadata"]["name"].startswith("a"):
            n["status"]["allocatable"]["nvidia.com/gpu"] = "0"
    same_rack = replan_recovery(request_, inv([*full_a, node("a0", 4, rack="r0", clique="A", product="GB200")]),
                                current, {"a0"})
    assert same_rack.plan.nodes[0].startswith("b")  # domain A is full: rack r0 before rack r1


def test_tensor_group_mate_is_replaced_inside_the_groups_domain() -> None:
    nodes = [node(f"a{i}", 4, clique="A", product="GB200") for i in range(3)]
    nodes += [node(f"b{i}", 4, clique="B", product="GB200") for i in range(3)]
    request_ = req(tensor=8, pipeline=1, data=1, gpus_per_pod=4)  # one TP group over 2 pods
    result = replan_recovery(request_, inv(nodes), {0: "a0", 1: "a1"}, {"a1"})
    assert result.mode == "incremental" and result.plan.nodes == {0: "a0", 1: "a2"}


def test_full_replan_when_constraints_cannot_be_kept_in_place() -> None:
    nodes = hgx([4, 4])  # Required pipeline: a replica never leaves its rack; rack 0 has no spare
    request_ = req(pipeline=4, data=1, pipeline_topology="Required")
    current = {i: f"n0-{i}" for i in range(4)}
    result = replan_recovery(request_, inv(nodes), current, {"n0-2"})
    assert result.mode == "full" and result.feasible
    assert {n[:2] for n in result.plan.nodes.values()} == {"n1"}
    assert result.moved == (0, 1, 2, 3)


def test_nothing_fits_says_why() -> None:
    result = replan_recovery(req(pipeline=2, data=1), inv(hgx([2])), {0: "n0-0", 1: "n0-1"}, {"n0-1"})
    assert not result.feasible and result.mode == "full"
    assert result.plan.reason == "pool H100-80GB: 8 free GPUs in 1 nodes, need 16 (2 pods x 8)"


def test_not_ready_node_counts_as_lost() -> None:
    nodes = hgx([3])
    nodes[1]["status"]["conditions"][0]["status"] = "False"
    result = replan_recovery(req(pipeline=2, data=1), inv(nodes), {0: "n0-0", 1: "n0-1"}, set())
    assert result.mode == "incremental" and result.moved == (1,) and result.plan.nodes[1] == "n0-2"


def test_shrink_keeps_the_healthiest_replicas() -> None:
    nodes = hgx([6])
    request_ = req(pipeline=2, data=3, min_data=1)
    current = {i: f"n0-{i}" for i in range(6)}  # replica r on n0-2r, n0-2r+1
    lost = {"n0-0", "n0-1", "n0-3"}  # replica 0 gone, replica 1 half gone, replica 2 healthy
    assert not replan_recovery(request_, inv(nodes), current, lost).feasible
    shrunk = plan_shrink(request_, inv(nodes), current, lost, 1)
    assert shrunk.feasible and shrunk.plan.data == 1
    assert shrunk.mode == "incremental" and shrunk.plan.nodes == {0: "n0-4", 1: "n0-5"} and shrunk.moved == ()
