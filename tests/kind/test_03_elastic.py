"""`kubectl scale` through the TrainingJob's scale subresource on real pods:
the data degree shrinks and grows again, and the job Succeeds."""

from __future__ import annotations

from pathlib import Path

from testbed.kube import Kube
from tests.kind.conftest import KindEnv, wait_for
from tests.kind.jobs import REFERENCE, assert_losses_match, losses, running_job


def _degree(status: dict[str, object]) -> int:
    current = status.get("parallelism") or {}
    assert isinstance(current, dict)
    return int(current.get("data") or 0)


def test_kubectl_scale_shrinks_and_grows_the_data_degree(
    kube: Kube, kind_env: KindEnv, bucket: str, tmp_path: Path
) -> None:
    with running_job(kube, kind_env, bucket, tmp_path, "scale", data=2, min_data=1, steps=24) as job:
        wait_for(lambda: job.status().get("phase") == "Running" and _degree(job.status()) == 2, 600,
                 "the job Running at dp=2")  # fmt: skip
        wait_for(lambda: int(job.status().get("checkpoint", {}).get("step") or 0) >= 4, 600,
                 "a committed checkpoint")  # fmt: skip
        kube.kubectl("-n", kind_env.namespace, "scale", "trainingjob", job.name, "--replicas=1")
        wait_for(lambda: job.status().get("phase") == "Running" and _degree(job.status()) == 1, 600,
                 "the job Running at dp=1")  # fmt: skip
        assert len([p for p in job.pods() if p["status"].get("phase") == "Running"]) == 2
        kube.kubectl("-n", kind_env.namespace, "scale", "trainingjob", job.name, "--replicas=2")
        wait_for(lambda: _degree(job.status()) == 2, 600, "the job back at dp=2")
        job.wait_phase("Succeeded")
        merged: dict[int, float] = {}
        for attempt in sorted(job.events()):
            merged.update(losses(job.events()[attempt]))
        assert max(merged) == 24
        # the uninterrupted reference ran 12 steps with another schedule length; only
        # the first steps (warmup, before any resize) are comparable
        if REFERENCE:
            early = {s: v for s, v in merged.items() if s <= 2}
            assert_losses_match(early, {s: REFERENCE[s] for s in early})
