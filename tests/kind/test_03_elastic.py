"""`kubectl scale` through the TrainingJob's scale subresource on real pods:
the data degree shrinks and grows again, and the job Succeeds. While it trains,
the trainer's Prometheus endpoint (the pods' `metrics` port) is scraped from
the control-plane node over the pod network, as a Prometheus in the cluster would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from topotrain.contract import DEFAULT_METRICS_PORT
from topotrain.core.manifests import INDEX_LABEL

from testbed.kube import Kube
from tests.kind.conftest import KindEnv, kubectl, scrape, wait_for
from tests.kind.jobs import REFERENCE, KindJob, assert_losses_match, losses, running_job

# The attempts at dp=2 and then dp=1 hold at HOLD (training.holdAtStep, a test aid) until a
# resize stops them, so both resizes land while the job trains, however fast the machine; the
# attempt after the second resize trains to the end. HOLD: two steps past the first commit (4).
STEPS, HOLD = 12, 6


def _degree(status: dict[str, object]) -> int:
    current = status.get("parallelism") or {}
    assert isinstance(current, dict)
    return int(current.get("data") or 0)


def _running_at(job: KindJob, data: int) -> Callable[[], bool]:
    """The job Running at `data`; a job that ended first fails at once, saying at which step."""

    def check() -> bool:
        status = job.status()
        if status.get("phase") in ("Succeeded", "Failed"):
            raise AssertionError(f"job {job.name} {status.get('phase')} before it ran at dp={data}: "
                                 f"{status.get('checkpoint')}, {status.get('parallelism')}")  # fmt: skip
        return status.get("phase") == "Running" and _degree(status) == data

    return check


def test_kubectl_scale_shrinks_and_grows_the_data_degree(
    kube: Kube, kind_env: KindEnv, bucket: str, tmp_path: Path
) -> None:
    with running_job(kube, kind_env, bucket, tmp_path, "scale", data=2, min_data=1, steps=STEPS,
                     metricsPort=DEFAULT_METRICS_PORT, holdAtStep=HOLD, holdAttempts=2) as job:  # fmt: skip
        wait_for(_running_at(job, 2), 600, "the job Running at dp=2")
        wait_for(lambda: int(job.status().get("checkpoint", {}).get("step") or 0) >= 4, 600,
                 "a committed checkpoint")  # fmt: skip
        # the trainer's metrics, as a Prometheus in the cluster reads them: pod 0's local rank 0
        pod0 = next(p for p in job.pods(attempt=0) if p["metadata"]["labels"][INDEX_LABEL] == "0")
        port = next(p["containerPort"] for p in pod0["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
        text = scrape(kube, kind_env, f"http://{pod0['status']['podIP']}:{port}/metrics")
        step = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("topotrain_step "))
        assert step >= 4, text[-2000:]
        assert 'topotrain_checkpoints_total{outcome="committed"}' in text, text[-2000:]
        kubectl(kube, "-n", kind_env.namespace, "scale", "trainingjob", job.name, "--replicas=1")
        wait_for(_running_at(job, 1), 600, "the job Running at dp=1")
        # the old gang's pods end once their SIGTERM save is done (phase Running while they stop)
        wait_for(lambda: len([p for p in job.pods() if p["status"].get("phase") == "Running"]) == 2, 120,
                 "exactly the two pods of dp=1 Running")  # fmt: skip
        kubectl(kube, "-n", kind_env.namespace, "scale", "trainingjob", job.name, "--replicas=2")
        wait_for(_running_at(job, 2), 600, "the job back at dp=2")
        job.wait_phase("Succeeded")
        merged: dict[int, float] = {}
        for attempt in sorted(job.events()):
            merged.update(losses(job.events()[attempt]))
        assert max(merged) == STEPS
        assert sorted(merged) == list(range(1, STEPS + 1)), "a step was never trained"
        # the uninterrupted reference ran 8 steps with another schedule length; only
        # the first steps (warmup, before any resize) are comparable
        if REFERENCE:
            early = {s: v for s, v in merged.items() if s <= 2}
            assert_losses_match(early, {s: REFERENCE[s] for s in early})
