"""The fleet and the job stream of bench/scale.py: seeded, so a seed replays the same run.

Fleet: two pools (H100-80GB and A100-80GB halves) of 8-GPU nodes in blocks of
racks (`testbed.topology.generate_scale_topology`); the H100 pool's nodes pair
up into NVLink domains (`nvidia.com/gpu.clique`, two HGX boards on one NVLink
switch), the A100 nodes are each their own domain.

Jobs (tensor 8 and 8 GPUs a pod, so one pod per tensor-parallel group):
small (pipeline 1, data 1-2), dense 3D (pipeline 2-4, data 2-4), elastic
(pipeline 2, data 4, minData 2) and one big gang (pipeline 8, `big_pods` pods),
arriving as a Poisson stream (exponential gaps of mean `interval` seconds).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from testbed.topology import TOPOLOGY_LABEL, generate_scale_topology

GPUS_PER_POD = 8
H100, A100 = "H100-80GB", "A100-80GB"
GPU_TYPE_CHOICES = ([H100, A100], [H100, A100], [H100, A100], [A100, H100], [H100])
KINDS = (("small", 0.4), ("dense", 0.35), ("elastic", 0.25))


def fleet(nodes: int, prefix: str) -> dict[str, Any]:
    """The topology for `nodes` nodes: racks of 10 nodes, blocks of 10 racks (or of 5; or 5 racks of 4)."""
    shapes = [(per_rack, racks) for per_rack, racks in ((10, 10), (10, 5), (4, 5))
              if nodes % (2 * per_rack * racks) == 0]
    if not shapes:
        raise ValueError(f"--nodes {nodes}: must be a multiple of 100 (or of 40)")
    shape = shapes[0]
    topology = generate_scale_topology(nodes, nodes_per_rack=shape[0], racks_per_block=shape[1],
                                       prefix=prefix)
    for pool in topology["pools"]:
        if pool["product"] == H100:
            pool["nvlinkDomainNodes"] = 2
    return topology


@dataclass(frozen=True)
class JobShape:
    name: str
    kind: str
    at: float  # seconds after the first arrival
    pipeline: int
    data: int
    min_data: int | None
    gpu_types: tuple[str, ...]
    tensor: int = 8

    @property
    def pods(self) -> int:
        return self.tensor * self.pipeline * self.data // GPUS_PER_POD

    def manifest(self, namespace: str, topology: str) -> dict[str, Any]:
        parallelism: dict[str, int] = {"tensor": self.tensor, "pipeline": self.pipeline, "data": self.data}
        if self.min_data is not None:
            parallelism["minData"] = self.min_data
        return {
            "apiVersion": "topotrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": self.name, "namespace": namespace,
                         "labels": {"bench.topotrain.io/kind": self.kind}},
            "spec": {
                "image": "topotrain/trainer:bench",
                "parallelism": parallelism,
                "worker": {"gpusPerPod": GPUS_PER_POD, "gpuTypes": list(self.gpu_types),
                           "nodeSelector": {TOPOLOGY_LABEL: topology}},
                # No trainer runs on KWOK's pods, so no supervisor can restart ranks in place.
                "failurePolicy": {"restartInPlace": False},
            },
        }  # fmt: skip


def big_gang_pods(smallest_fleet: int) -> int:
    """128 pods from 500 nodes up; below that the largest power of two within a quarter of the fleet."""
    if smallest_fleet >= 500:
        return 128
    pods = 8
    while pods * 2 <= smallest_fleet // 4:
        pods *= 2
    return pods


def job_stream(jobs: int, big_pods: int, interval: float, seed: int) -> list[JobShape]:
    """`jobs` jobs, one of them the big gang (a third of the way in), in arrival order."""
    rng = random.Random(seed)
    shapes: list[JobShape] = []
    at = 0.0
    big_index = jobs // 3
    for i in range(jobs):
        if i:
            at += rng.expovariate(1 / interval) if interval > 0 else 0.0
        if i == big_index:
            pipeline = 8 if big_pods % 8 == 0 else 1
            shapes.append(JobShape(f"big-{i:03d}", "big", at, pipeline, big_pods // pipeline, None, (H100, A100)))
            continue
        kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
        types = tuple(rng.choice(GPU_TYPE_CHOICES))
        if kind == "small":
            shape = JobShape(f"small-{i:03d}", kind, at, 1, rng.randint(1, 2), None, types)
        elif kind == "dense":
            shape = JobShape(f"dense-{i:03d}", kind, at, rng.randint(2, 4), rng.randint(2, 4), None, types)
        else:
            shape = JobShape(f"elastic-{i:03d}", kind, at, 2, 4, 2, types)
        shapes.append(shape)
    return shapes
