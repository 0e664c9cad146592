"""bench/versus_jobs.py: the cost model is evaluated on every node of the fleet, whether or
not it was usable when the fleet was listed (a 5,000-node run lost 16 placement instances
to nodes that were not Ready yet at that moment)."""

from __future__ import annotations

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
        for name in [n for n in sys.modules if n in ("versus_jobs", "scale_workload")]:
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
