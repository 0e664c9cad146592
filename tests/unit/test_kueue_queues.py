"""testbed/kueue_queues.py: the queue objects bench/versus.py and the Kueue tests give Kueue."""

from __future__ import annotations

from testbed.kueue_queues import queue_manifests
from testbed.topology import GPU_RESOURCE, parse_topology

TOPOLOGY = {
    "name": "q",
    "pools": [
        {"name": "h100", "product": "H100-80GB", "blocks": 1, "racksPerBlock": 1, "nodesPerRack": 2,
         "gpusPerNode": 8, "nvlinkDomainNodes": 2},
        {"name": "a100", "product": "A100-80GB", "blocks": 1, "racksPerBlock": 1, "nodesPerRack": 2,
         "gpusPerNode": 8, "nvlinkDomainNodes": 1},
    ],
}  # fmt: skip


def _by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_one_cluster_queue_without_preference_orders() -> None:
    made = queue_manifests(parse_topology(TOPOLOGY), "ns", prefix="v")
    cqs = _by_kind(made.manifests(), "ClusterQueue")
    assert list(cqs) == ["v-cq"] == made.cluster_queues
    assert "cohortName" not in cqs["v-cq"]["spec"]
    flavors = cqs["v-cq"]["spec"]["resourceGroups"][0]["flavors"]
    assert [f["name"] for f in flavors] == ["v-h100", "v-a100"]
    assert made.queue_for(["A100-80GB", "H100-80GB"]) == "v"


def test_a_job_preferring_the_second_flavor_gets_a_queue_trying_it_first_on_shared_quota() -> None:
    made = queue_manifests(parse_topology(TOPOLOGY), "ns", prefix="v", preference_orders=True)
    objects = made.manifests()
    cqs, lqs = _by_kind(objects, "ClusterQueue"), _by_kind(objects, "LocalQueue")
    assert made.cluster_queues == ["v-cq", "v-cq-a100-first"] == list(cqs)
    assert {n: q["spec"]["clusterQueue"] for n, q in lqs.items()} == {
        "v": "v-cq", "v-a100-first": "v-cq-a100-first"}  # fmt: skip
    assert {q["spec"]["cohortName"] for q in cqs.values()} == {"v-cohort"}
    first, second = (cqs[n]["spec"]["resourceGroups"][0]["flavors"] for n in made.cluster_queues)
    assert [f["name"] for f in second] == ["v-a100", "v-h100"]
    # all the quota is the first ClusterQueue's; the other borrows it (no borrowing limit)
    assert {f["name"]: f["resources"][0] for f in first} == {
        "v-h100": {"name": GPU_RESOURCE, "nominalQuota": "16"},
        "v-a100": {"name": GPU_RESOURCE, "nominalQuota": "16"}}  # fmt: skip
    assert all(r == {"name": GPU_RESOURCE, "nominalQuota": "0"}
               for f in second for r in f["resources"])  # fmt: skip
    assert made.queue_for(["A100-80GB", "H100-80GB"]) == "v-a100-first"
    assert made.queue_for(["H100-80GB", "A100-80GB"]) == "v"
    assert made.queue_for(["H100-80GB"]) == "v"
    assert made.queue_for([]) == "v"
