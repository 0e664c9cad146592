"""TrainingJobs across clusters with the real Kueue's MultiKueue (v0.17, testbed processes):
a manager and two worker control planes, each with its own KWOK fleet, Kueue and topotrain,
one shared S3 server (testbed/multicluster.py). The pods run the stand-in trainer
(testbed/standin.py), not torch, through the pod process harness.

A job applied on the manager (`spec.managedBy: kueue.x-k8s.io/multikueue`) runs on a worker and
its status appears on the manager; the worker's Kueue, with waitForPodsReady on, does not evict it
once its pods run; deleted on the manager it goes from the worker; when its
worker cluster is lost, MultiKueue dispatches it to the other worker, where it resumes its run's
newest committed checkpoint and finishes with the losses of an uninterrupted run.

The three control planes are started once for the module (about two minutes of the test's
time on a two-core machine)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from testbed.binaries import binary
from testbed.harness_stack import Stack
from testbed.kueue import QUEUE_LABEL
from testbed.multicluster import PODS_READY_SECONDS, WORKERS, MultiCluster, copies
from testbed.procs import wait_until
from testbed.standin import expected_losses

pytestmark = [pytest.mark.integration, pytest.mark.kueue, pytest.mark.timeout(900)]

STANDIN = Path(__file__).resolve().parents[2] / "testbed" / "standin.py"
SEED = 7
TIMEOUT = 240.0


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiCluster]:
    try:
        binary("kueue")
    except FileNotFoundError as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{err} (CI=true: not skipping)", pytrace=False)
        pytest.skip(str(err))
    with MultiCluster(tmp_path_factory.mktemp("multicluster")) as made:
        yield made


def _spec(steps: int, hold: int) -> dict[str, Any]:
    """Two one-GPU pods of the stand-in; a commit every 4 steps; the first attempt holds after
    step `hold` until released (a run resumed past it goes on)."""
    return {
        "managedBy": "kueue.x-k8s.io/multikueue",
        "command": ["python", str(STANDIN)],
        "parallelism": {"data": 2},
        "worker": {"gpusPerPod": 1, "gpuTypes": ["H100-80GB"]},
        "checkpoint": {"intervalSteps": 4, "keep": 3},
        "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 2},
        "training": {"steps": steps, "stepSeconds": 0.2, "seed": SEED, "holdAtStep": hold},
    }


def _labels(clusters: MultiCluster) -> dict[str, str]:
    return {QUEUE_LABEL: clusters.queues(0).local_queue}


def _manager(clusters: MultiCluster) -> Stack:
    assert clusters.manager.stack is not None
    return clusters.manager.stack


def _where(clusters: MultiCluster, job: str) -> str | None:
    """The worker holding a copy of `job`, if any."""
    for name in WORKERS:
        if any(c["metadata"]["name"] == job for c in copies(clusters.worker(name), clusters.namespace)):
            return name
    return None


def _status(job: dict[str, Any]) -> dict[str, Any]:
    return dict(job.get("status") or {})


def _worker_workload(stack: Stack, job: str) -> dict[str, Any]:
    """The Workload MultiKueue built on a worker, once its PodsReady condition is True."""
    seen: dict[str, Any] = {}

    def ready() -> bool:
        out = stack.kubectl("-n", stack.namespace, "get", f"workloads.kueue.x-k8s.io/trainingjob-{job}",
                            "-o", "json", check=False)
        seen.update(json.loads(out.stdout) if out.returncode == 0 else {})
        return _condition(seen, "PodsReady").get("status") == "True"

    wait_until(ready, timeout=TIMEOUT, what=f"the worker's Workload of {job} PodsReady")
    return seen


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def test_a_job_runs_on_a_worker_and_deleted_on_the_manager_goes_from_it(clusters: MultiCluster) -> None:
    manager = _manager(clusters)
    manager.apply_job("gone", _spec(steps=60, hold=2), _labels(clusters))
    job = manager.wait_job("gone", lambda j: _status(j).get("phase") == "Running", timeout=TIMEOUT,
                           what="Running, as the worker's status copied to the manager")
    assert _status(job)["parallelism"]["data"] == 2, _status(job)
    assert manager.pods("gone") == [], "the manager runs no pod of a job MultiKueue dispatches"
    where = _where(clusters, "gone")
    assert where is not None
    worker = clusters.worker(where)
    assert worker.stack is not None
    copy = worker.stack.job("gone")
    assert "managedBy" not in copy["spec"]
    labels = copy["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/prebuilt-workload-name"] == "trainingjob-gone", labels
    assert len(worker.stack.pods("gone")) == 2
    # The worker's Kueue runs with waitForPodsReady: the Workload says the pods are ready, and
    # the job is not evicted once its timeout has passed since admission.
    workload = _worker_workload(worker.stack, "gone")
    assert _condition(workload, "PodsReady").get("reason") == "Started", workload.get("status")
    admitted = datetime.fromisoformat(_condition(workload, "Admitted")["lastTransitionTime"].replace("Z", "+00:00"))
    wait_until(lambda: (datetime.now(UTC) - admitted).total_seconds() > PODS_READY_SECONDS + 3,
               timeout=PODS_READY_SECONDS + 10, what="the PodsReady timeout passed since admission")
    workload = _worker_workload(worker.stack, "gone")
    assert _condition(workload, "Evicted").get("status") != "True", workload.get("status")
    assert _status(worker.stack.job("gone")).get("restarts", 0) == 0
    manager.kubectl("-n", manager.namespace, "delete", "trainingjob", "gone", "--wait=false")
    wait_until(lambda: _where(clusters, "gone") is None and not worker.stack.pods("gone"),  # type: ignore[union-attr]
               timeout=TIMEOUT, what="the worker's copy and its pods gone after the delete on the manager")


def test_a_job_whose_worker_is_lost_resumes_its_run_on_the_other_worker(clusters: MultiCluster) -> None:
    manager = _manager(clusters)
    created = manager.apply_job("move", _spec(steps=12, hold=8), _labels(clusters))
    run = created["metadata"]["uid"]
    held = manager.wait_job(
        "move", lambda j: _status(j).get("phase") == "Running"
        and ((_status(j).get("checkpoint") or {}).get("step") or 0) >= 8,
        timeout=TIMEOUT, what="Running with step 8 committed, on the manager")  # fmt: skip
    assert held["status"]["checkpoint"]["step"] == 8
    first = _where(clusters, "move")
    assert first is not None
    other = next(w for w in WORKERS if w != first)
    clusters.lose(first)
    done = manager.wait_job(
        "move", lambda j: _status(j).get("phase") == "Succeeded", timeout=TIMEOUT,
        what="Succeeded on the other worker after the first was lost")  # fmt: skip
    resumed = done["status"].get("resumedFrom") or {}
    assert resumed.get("sameRun") is True and resumed.get("uid") == run and resumed.get("step") == 8, done["status"]
    stack = clusters.worker(other).stack
    assert stack is not None
    events = stack.events("move")
    starts = [e for e in events if e.get("event") == "start"]
    assert [e.get("resume") for e in starts] == [8], starts
    expected = expected_losses(SEED, 12)
    losses = {int(e["step"]): float(e["loss"]) for e in events if e.get("event") == "step"}
    assert losses == {s: expected[s] for s in range(9, 13)}, "not the uninterrupted run's losses"
