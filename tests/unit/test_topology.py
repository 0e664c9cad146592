"""Inventory rules: which nodes count and how many GPUs are free on them."""

from __future__ import annotations

from typing import Any

import pytest
from test_placement_support import node, pod
from topotrain.placement.topology import Inventory, TopologyLevels, pod_gpus, tolerates

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("kwargs", "tolerations", "selector", "usable", "why"),
    [
        ({}, [], {}, True, ""),
        ({"ready": False}, [], {}, False, "not Ready"),
        ({"unschedulable": True}, [], {}, False, "unschedulable"),
        ({"taints": [GPU_TAINT]}, [], {}, False, "taint nvidia.com/gpu=present:NoSchedule not tolerated"),
        ({"taints": [GPU_TAINT]}, [{"key": "nvidia.com/gpu", "operator": "Exists"}], {}, True, ""),
        ({"taints": [GPU_TAINT]}, [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}], {}, True, ""),
        ({"taints": [GPU_TAINT]}, [{"key": "nvidia.com/gpu", "value": "other"}], {}, False, "not tolerated"),
        ({"taints": [GPU_TAINT]}, [{"operator": "Exists"}], {}, True, ""),
        ({"taints": [GPU_TAINT]}, [{"operator": "Exists", "effect": "NoExecute"}], {}, False, "not tolerated"),
        ({"taints": [{"key": "x", "effect": "NoExecute"}]}, [], {}, False, "x=:NoExecute"),
        ({"taints": [{"key": "x", "effect": "PreferNoSchedule"}]}, [], {}, True, ""),
        ({"labels": {"team": "a"}}, [], {"team": "a"}, True, ""),
        ({"labels": {"team": "b"}}, [], {"team": "a"}, False, "nodeSelector team=a"),
        ({}, [], {"team": "a"}, False, "nodeSelector team=a"),
        ({"gpus": 0}, [], {}, False, "no allocatable nvidia.com/gpu"),
    ],
)
def test_which_nodes_count(
    kwargs: dict[str, Any], tolerations: list[dict[str, str]], selector: dict[str, str], usable: bool, why: str
) -> None:
    inv = Inventory.from_snapshot([node("n1", **kwargs)], [], tolerations=tolerations, node_selector=selector)
    assert ("n1" in inv.nodes) is usable
    if not usable:
        assert why in inv.excluded["n1"]


@pytest.mark.parametrize(
    ("pods", "free"),
    [
        ([], 8),
        ([pod("n1", 3)], 5),
        ([pod("n1", 3), pod("n1", 2)], 3),
        ([pod("n1", 3, limits_only=True)], 5),  # limits stand in for absent requests
        ([pod("n1", 4, phase="Succeeded"), pod("n1", 4, phase="Failed")], 8),  # terminal pods hold nothing
        ([pod("n1", 2, phase="Pending")], 6),  # bound but not started still holds its GPUs
        ([pod(None, 8)], 8),  # not bound to a node
        ([pod("n2", 8)], 8),  # another node
        ([pod("n1", 16)], 0),  # never negative
    ],
)
def test_free_gpus(pods: list[dict[str, Any]], free: int) -> None:
    inv = Inventory.from_snapshot([node("n1"), node("n2")], pods)
    assert inv.nodes["n1"].free == free


def test_reserved_gpus_and_ignored_pods() -> None:
    mine = pod("n1", 4, labels={"topotrain.io/job": "llm"})
    other = pod("n1", 2, labels={"topotrain.io/job": "other"})
    inv = Inventory.from_snapshot(
        [node("n1"), node("n2")], [mine, other], ignore_pods_of={"topotrain.io/job": "llm"}, reserved={"n2": 8}
    )
    assert inv.nodes["n1"].free == 6  # the job's own pod does not count, the other job's does
    assert inv.nodes["n2"].free == 0  # created-but-unseen pods are reserved
    assert inv.reserve({"n1": 6}).nodes["n1"].free == 0


def test_init_containers_count_as_the_scheduler_does() -> None:
    spec = {
        "containers": [{"resources": {"requests": {"nvidia.com/gpu": "2"}}}] * 2,
        "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": 8}}}],
    }
    assert pod_gpus(spec) == 8
    spec["initContainers"] = [{"resources": {"limits": {"nvidia.com/gpu": 1}}}]
    assert pod_gpus(spec) == 4


def test_domains_pools_and_custom_labels() -> None:
    nodes = [
        node("a1", block="b1", rack="r1", clique="nvl-1", product="GB200"),
        node("a2", block="b1", rack="r1", clique="nvl-1", product="GB200"),
        node("h1", block="b2", rack="r9", product="H100-80GB"),
    ]
    inv = Inventory.from_snapshot(nodes, [])
    assert inv.nodes["a1"].nvlink == inv.nodes["a2"].nvlink == ("b1", "r1", "nvl-1")
    assert inv.nodes["h1"].nvlink == ("b2", "r9", "host:h1")  # no clique label: the node is its own domain
    assert {p: [n.name for n in ns] for p, ns in inv.pools().items()} == {"GB200": ["a1", "a2"], "H100-80GB": ["h1"]}
    custom = TopologyLevels(rack="example.com/row")
    relabelled = node("x", labels={"example.com/row": "row-3"})
    assert Inventory.from_snapshot([relabelled], [], custom).nodes["x"].rack == ("b0", "row-3")


def test_snake_case_client_dicts() -> None:
    """The Kubernetes client's `.to_dict()` spells nodeName as node_name."""
    bound = {"metadata": {"name": "p"}, "spec": {"node_name": "n1", "containers": [
        {"resources": {"requests": {"nvidia.com/gpu": "5"}, "limits": None}}]}, "status": {"phase": "Running"}}
    assert Inventory.from_snapshot([node("n1")], [bound]).nodes["n1"].free == 3


def test_lost_nodes_stay_known_without_capacity() -> None:
    inv = Inventory.from_snapshot([node("n1"), node("n2", ready=False)], [])
    assert inv.known["n2"].free == 0 and "n2" not in inv.nodes
    smaller = inv.without({"n1"})
    assert "n1" not in smaller.nodes and smaller.known["n1"].free == 0 and smaller.excluded["n1"] == "lost"


def test_toleration_matching_rule() -> None:
    taint = {"key": "k", "value": "v", "effect": "NoExecute"}
    assert tolerates(taint, [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute"}])
    assert not tolerates(taint, [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"}])
    assert not tolerates(taint, [{"key": "other", "operator": "Exists"}])
