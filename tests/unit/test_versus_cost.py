"""bench/versus_jobs.py: the cost model is evaluated on every node of the fleet, whether or
not it was usable when the fleet was listed (a 5,000-node run lost 16 placement instances
to nodes that were not Ready yet at that moment); bench/versus_report.py: the predicted step
time of each system's placement of the same job, from the node names each system gave it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from testbed.topology import node_manifest, parse_topology, plan_nodes

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def versus_jobs() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))
    try:
        import versus_jobs

        yield versus_jobs
    finally:
        sys.path.remove(str(BENCH))
        bench = ("versus_jobs", "scale_workload", "versus_report", "versus_results", "versus_watch", "placement")
        for name in [n for n in sys.modules if n in bench]:
            del sys.modules[name]


def _ready(node: dict[str, object], ready: bool) -> dict[str, object]:
    status = dict(node["status"])  # type: ignore[call-overload]
    status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {**node, "status": status}


def test_nodes_not_ready_when_listed_still_count_for_the_cost(versus_jobs: ModuleType) -> None:
    from scale_workload import JobShape, fleet

    topology = fleet(40, "v-")
    nodes = [node_manifest(plan, str(topology["name"])) for plan in plan_nodes(parse_topology(topology))]
    h100 = sorted(n["metadata"]["name"] for n in nodes if "-h100-" in n["metadata"]["name"])
    late = set(h100[:4])  # not Ready yet when listed
    listed = [_ready(n, n["metadata"]["name"] not in late) for n in nodes]
    pools = versus_jobs.fleet_pools(listed)
    assert {info.name for infos in pools.values() for info in infos} == {n["metadata"]["name"] for n in nodes}
    shape = JobShape("dense-000", "dense", 0.0, 2, 4, None, ("H100-80GB",))  # 4 pods of 8 GPUs
    placed = versus_jobs.placement_cost(shape, dict(enumerate(h100[:4])), pools)
    assert placed is not None and placed.nodes == tuple(h100[:4])
    # the gang in one rack's first four nodes: no block crossing
    assert placed.block == 0


def test_the_report_predicts_each_systems_step_time_on_the_same_job(
        versus_jobs: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """A Kueue placement is only node names: they are mapped back to the fleet's topology, and
    the gang whose DP rings cross blocks is predicted slower than the one inside a rack."""
    import versus_report
    from scale_workload import JobShape, fleet
    from versus_report import print_placement
    from versus_results import Instance, PlacementResult

    topology = fleet(80, "v-")  # per pool 2 blocks of 5 racks of 4 nodes; H100 nodes in pairs on NVLink
    pools = versus_jobs.fleet_pools([node_manifest(p, "v") for p in plan_nodes(parse_topology(topology))])
    dense = JobShape("dense-001", "dense", 0.0, 2, 2, None, ("H100-80GB",))  # tp8 pp2 dp2: 4 pods
    one_rack = [f"v-h100-b0-r0-n{i}" for i in range(4)]
    two_blocks = ["v-h100-b0-r0-n0", "v-h100-b0-r0-n1", "v-h100-b1-r0-n0", "v-h100-b1-r0-n1"]
    ours = versus_jobs.placement_cost(dense, dict(enumerate(one_rack)), pools)
    theirs = versus_jobs.placement_cost(dense, dict(enumerate(two_blocks)), pools)
    assert ours.step is not None and theirs.step is not None and theirs.step > ours.step
    small = JobShape("small-002", "small", 0.0, 1, 1, None, ("A100-80GB",))
    alone = versus_jobs.placement_cost(small, {0: "v-a100-b1-r3-n2"}, pools)
    result = PlacementResult(seeds=[1], instances=[
        Instance(1, dense, ours, theirs), Instance(1, small, alone, alone), Instance(1, small, alone, None)])
    print_placement(result, "topotrain", "Kueue", argparse.Namespace(nodes=80, used=0.3))
    out = capsys.readouterr().out
    ratio = theirs.step / ours.step
    bound = ours.steps[versus_report.FIRST][1]
    assert bound < ours.step  # one rack, but the pipeline pairs share the NVLink domains
    assert f"| dense-001@1 | {ours.step:.3f} | {theirs.step:.3f} | {bound:.3f} | {ratio:.3f}x |" in out
    assert f"| small-002@1 | {alone.step:.3f} | - | {alone.step:.3f} | - |" in out
    assert (f"geo-mean predicted step ratio (Kueue / topotrain) over 2 jobs placed by both at the same "
            f"size: {ratio ** 0.5:.3f}x; worst 1.000x; jobs where topotrain's step is slower: 0") in out


def test_no_placement_is_predicted_faster_than_the_step_bound(versus_jobs: ModuleType) -> None:
    """The report's step bound: random placements of several shapes in either pool are never
    predicted faster, for any workload; two replicas sharing one NVLink domain attain it."""
    import random

    from scale_workload import JobShape, fleet

    topology = fleet(80, "v-")
    pools = versus_jobs.fleet_pools([node_manifest(p, "v") for p in plan_nodes(parse_topology(topology))])
    rng = random.Random(7)
    for pipeline, data in ((1, 2), (2, 2), (3, 2), (2, 4), (4, 4)):
        shape = JobShape("dense-000", "dense", 0.0, pipeline, data, None, ("H100-80GB",))
        for infos in pools.values():
            for _ in range(20):
                nodes = rng.sample([n.name for n in infos], shape.pods)
                placed = versus_jobs.placement_cost(shape, dict(enumerate(nodes)), pools)
                assert placed is not None and len(placed.steps) == len(versus_jobs.STEP_WORKLOADS)
                for label, (step, best) in placed.steps.items():
                    assert step >= best * (1 - 1e-9), (label, nodes)
    pair = JobShape("small-001", "small", 0.0, 1, 2, None, ("H100-80GB",))  # two replicas, one domain: attained
    placed = versus_jobs.placement_cost(pair, {0: "v-h100-b0-r0-n0", 1: "v-h100-b0-r0-n1"}, pools)
    assert placed is not None
    for step, best in placed.steps.values():
        assert step == pytest.approx(best, rel=1e-9)
