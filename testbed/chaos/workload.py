"""The soak's workload: a stream of TrainingJobs of three shapes, kept at a
fixed number running at once, each run by the stand-in trainer
(testbed/standin.py) for a seeded number of steps.

- dense: tensor 2 x pipeline 2 x data 2 over two 4-GPU pods, H100 only,
  tensor groups Required inside one NVLink domain;
- elastic: data 4 (minData 2) of 1-GPU pods over the H100 and A100 pools;
- tiny: one 1-GPU pod;
- queued (only when the soak runs Kueue, testbed/chaos/queued.py): data 2 of 1-GPU pods on the
  queued pool, labelled for Kueue's LocalQueue; every fourth job then.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from testbed.binaries import REPO_ROOT
from testbed.chaos.history import History
from testbed.chaos.queued import PRODUCT as QUEUED_PRODUCT
from testbed.harness_stack import Stack

STANDIN = REPO_ROOT / "testbed" / "standin.py"
INTERVAL_STEPS = 10
KEEP = 2


@dataclass(frozen=True)
class Shape:
    name: str
    tensor: int
    pipeline: int
    data: int
    min_data: int | None
    gpus_per_pod: int
    gpu_types: tuple[str, ...]


SHAPES = (
    Shape("dense", 2, 2, 2, None, 4, ("H100-80GB",)),
    Shape("elastic", 1, 1, 4, 2, 1, ("H100-80GB", "A100-80GB")),
    Shape("tiny", 1, 1, 1, None, 1, ("A100-80GB", "H100-80GB")),
)
QUEUED = Shape("queued", 1, 1, 2, None, 1, (QUEUED_PRODUCT,))


@dataclass(frozen=True)
class JobPlan:
    name: str
    shape: Shape
    seed: int
    steps: int


def job_spec(plan: JobPlan, step_seconds: float) -> dict[str, Any]:
    shape = plan.shape
    parallelism: dict[str, Any] = {"tensor": shape.tensor, "pipeline": shape.pipeline, "data": shape.data}
    if shape.min_data:
        parallelism["minData"] = shape.min_data
    return {
        "command": ["python", str(STANDIN)],
        "parallelism": parallelism,
        "worker": {"gpusPerPod": shape.gpus_per_pod, "gpuTypes": list(shape.gpu_types)},
        "topology": {"tensor": "Required", "pipeline": "Preferred", "data": "Preferred"},
        "checkpoint": {"intervalSteps": INTERVAL_STEPS, "keep": KEEP},
        "failurePolicy": {
            "maxRestarts": 60, "maxInfrastructureRestarts": 200, "backoffSeconds": 1,
            "maxBackoffSeconds": 4, "progressTimeoutSeconds": 20, "startupTimeoutSeconds": 60,
            "schedulingTimeoutSeconds": 180,
        },
        "training": {"steps": plan.steps, "stepSeconds": step_seconds, "seed": plan.seed},
    }  # fmt: skip


class Workload:
    """The jobs of the soak, created through `stack` in `namespace`, each step recorded in `history`."""

    def __init__(self, stack: Stack, history: History, namespace: str, seed: int, concurrent: int,
                 steps: tuple[int, int], step_seconds: float,
                 queue_labels: dict[str, str] | None = None) -> None:  # fmt: skip
        self.stack, self.history, self.namespace = stack, history, namespace
        self.queue_labels = queue_labels  # Kueue runs: the queued shape's LocalQueue label
        self.shapes = (*SHAPES, QUEUED) if queue_labels else SHAPES
        self.random = random.Random(seed ^ 0x5EED)
        self.concurrent = concurrent
        self.steps = steps
        self.step_seconds = step_seconds
        self.plans: dict[str, JobPlan] = {}
        self.active: set[str] = set()
        self.deleted: set[str] = set()
        self.serial = 0
        self._lock = threading.Lock()

    def shape_of(self, job: str) -> Shape:
        return self.plans[job].shape

    def job_names(self) -> list[str]:
        with self._lock:
            return sorted(self.active)

    def submit(self) -> JobPlan:
        with self._lock:
            shape = self.shapes[self.serial % len(self.shapes)]
            plan = JobPlan(f"{shape.name}-{self.serial:04d}", shape, self.random.randrange(1 << 30),
                           self.random.randint(*self.steps))  # fmt: skip
            self.serial += 1
            self.plans[plan.name] = plan
            self.active.add(plan.name)
        try:
            labels = self.queue_labels if shape is QUEUED else None
            self.stack.apply_job(plan.name, job_spec(plan, self.step_seconds), labels)
        except Exception:
            with self._lock:  # never created: not part of the workload
                self.plans.pop(plan.name)
                self.active.discard(plan.name)
            raise
        self.history.add("job-created", job=plan.name, shape=shape.name, seed=plan.seed,
                         steps=plan.steps, interval=INTERVAL_STEPS, keep=KEEP)  # fmt: skip
        return plan

    def delete(self, job: str) -> None:
        with self._lock:
            self.active.discard(job)
            self.deleted.add(job)
        self.history.add("job-deleted", job=job)
        try:
            self.stack.custom.delete_namespaced_custom_object(
                "topotrain.io", "v1alpha1", self.namespace, "trainingjobs", job)
        except ApiException as err:
            if err.status != 404:
                raise

    def tick(self, keep_going: bool) -> None:
        """Retire jobs the API server shows finished; top the stream back up while `keep_going`."""
        seen = self.history.last("api")
        if seen is not None:
            finished = {j["name"]: j["phase"] for j in seen["jobs"] if j["phase"] in ("Succeeded", "Failed")}
            with self._lock:
                done = [j for j in self.active if j in finished]
                self.active.difference_update(done)
            for job in done:
                self.history.add("job-finished", job=job, phase=finished[job])
        while keep_going and len(self.job_names()) < self.concurrent:
            self.submit()
