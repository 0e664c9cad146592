"""TrainingJobs on the kind cluster: the manifest, status and pods, the trainer's logs."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topotrain.core.manifests import ATTEMPT_LABEL, CONTAINER, INDEX_LABEL, JOB_LABEL

from testbed.harness_proc import events_by_attempt
from testbed.kube import Kube
from tests.datasets import dataset_uri
from tests.kind.conftest import DATA_BUCKET, KindEnv, kubectl, kubectl_json, wait_for

# Small enough for two CPU cores: 8 gloo ranks of the tiny model. 8 steps: one committed
# checkpoint (4) before the failure tests' fault (they hold at 6) and one after their restart.
STEPS = 8
INTERVAL = 4
JOB_TIMEOUT = 900.0
# Two runs of the trainer on CPU agree within this (tests/e2e/jobs.py, docs/trainer.md).
LOSS_ATOL = 2e-5
# Losses of the uninterrupted run (test_01_training), for the recovery tests to compare with.
REFERENCE: dict[int, float] = {}


def training(steps: int = STEPS, **extra: Any) -> dict[str, Any]:
    """Trains from the session's tokenized shards in S3 (the `bucket` fixture writes them first)."""
    return {"model": "tiny", "steps": steps, "globalBatch": 8, "microBatch": 2, "progressEvery": 1,
            "metricsPort": 0, "dataset": dataset_uri(DATA_BUCKET), **extra}  # fmt: skip


def manifest(env: KindEnv, name: str, bucket: str, *, data: int = 2, min_data: int | None = None,
             steps: int = STEPS, **training_extra: Any) -> dict[str, Any]:  # fmt: skip
    """tp=2, pp=2, dp=`data` on 2-GPU pods in the KIND-CPU pool."""
    parallelism: dict[str, Any] = {"tensor": 2, "pipeline": 2, "data": data}
    if min_data is not None:
        parallelism["minData"] = min_data
    return {
        "apiVersion": "topotrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": env.namespace},
        "spec": {
            "image": env.trainer_image,
            "imagePullPolicy": "Never",
            "parallelism": parallelism,
            "worker": {"gpusPerPod": 2, "gpuTypes": ["KIND-CPU"]},
            "checkpoint": {
                "uri": f"s3://{bucket}/jobs", "endpoint": env.s3_endpoint,
                "credentialsSecret": env.s3_secret, "intervalSteps": INTERVAL, "keep": 3,
            },
            "failurePolicy": {"backoffSeconds": 0, "maxRestarts": 5, "progressTimeoutSeconds": 300},
            "training": training(steps, **training_extra),
        },
    }


@dataclass
class KindJob:
    kube: Kube
    env: KindEnv
    name: str
    logs: Path
    _followers: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    # every pod seen while the job ran, last observed state (the operator deletes a
    # finished job's pods)
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def get(self) -> dict[str, Any]:
        return kubectl_json(self.kube, "-n", self.env.namespace, "get", "trainingjob", self.name)  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        return self.get().get("status", {})  # type: ignore[no-any-return]

    def wait_phase(self, phase: str, timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            st = self.status()
            if st.get("phase") == "Failed" and phase != "Failed":
                raise AssertionError(f"job {self.name} Failed: {json.dumps(st, indent=1)}")
            return st if st.get("phase") == phase else None

        return wait_for(reached, timeout, f"job {self.name} to be {phase}", every=2)  # type: ignore[no-any-return]

    def pods(self, attempt: int | None = None) -> list[dict[str, Any]]:
        selector = f"{JOB_LABEL}={self.name}"
        if attempt is not None:
            selector += f",{ATTEMPT_LABEL}={attempt}"
        items = kubectl_json(self.kube, "-n", self.env.namespace, "get", "pods", "-l", selector)["items"]
        return items  # type: ignore[no-any-return]

    # --- the trainer's JSON log lines, from each attempt's pod 0 (global rank 0)

    def _follow(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):
                for pod in self.pods():
                    name = pod["metadata"]["name"]
                    self.seen[name] = pod
                    labels = pod["metadata"]["labels"]
                    # Only once the container runs (or ran): `kubectl logs -f` on a container still
                    # being created (its image unpacking) fails at once and is not retried.
                    started = any(
                        s.get("state", {}).get("running") or s.get("state", {}).get("terminated")
                        for s in pod.get("status", {}).get("containerStatuses") or []
                    )
                    if labels.get(INDEX_LABEL) != "0" or name in self._followers or not started:
                        continue
                    out = (self.logs / f"a{labels[ATTEMPT_LABEL]}-{name}.log").open("w")
                    self._followers[name] = subprocess.Popen(
                        ["kubectl", "--kubeconfig", str(self.kube.kubeconfig), "-n", self.env.namespace,
                         "logs", "-f", name, "-c", CONTAINER],
                        stdout=out, stderr=subprocess.STDOUT, text=True,
                    )  # fmt: skip

    def seen_pods(self, attempt: int) -> list[dict[str, Any]]:
        return [p for p in self.seen.values() if p["metadata"]["labels"].get(ATTEMPT_LABEL) == str(attempt)]

    def events(self) -> dict[int, list[dict[str, Any]]]:
        """JSON log events of global rank 0, per attempt.

        A pod kept across an in-place restart logs several attempts: its supervisor's
        `workers_started` event names the attempt the lines after it belong to."""
        return events_by_attempt(sorted(self.logs.glob("a*.log")))

    def diagnose(self) -> str:
        """What a failed test needs to see: the job's status, its Events, the operator's last lines."""
        parts = []
        with contextlib.suppress(Exception):
            parts.append("status: " + json.dumps(self.status(), indent=1))
        with contextlib.suppress(Exception):
            parts.append(self.kube.kubectl(
                "-n", self.env.namespace, "get", "events", "--sort-by=.lastTimestamp",
                f"--field-selector=involvedObject.name={self.name}", check=False).stdout)  # fmt: skip
        with contextlib.suppress(Exception):
            parts.append(self.kube.kubectl(
                "-n", self.env.operator_namespace, "logs", "deployment/topotrain", "--tail=60",
                check=False).stdout)  # fmt: skip
        return "\n".join(str(p) for p in parts)

    def close(self) -> None:
        self._stop.set()
        for proc in self._followers.values():
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


@contextlib.contextmanager
def running_job(kube: Kube, env: KindEnv, bucket: str, tmp_path: Path, stem: str,
                **kwargs: Any) -> Iterator[KindJob]:  # fmt: skip
    """A TrainingJob created from `manifest(**kwargs)`, its logs followed; deleted afterwards."""
    name = f"{stem}-{uuid.uuid4().hex[:5]}"
    body = manifest(env, name, bucket, **kwargs)
    _apply(kube, body)
    job = KindJob(kube, env, name, tmp_path)
    follower = threading.Thread(target=job._follow, daemon=True)
    follower.start()
    try:
        yield job
    except BaseException:
        print(f"--- job {name} at the failure ---\n{job.diagnose()}")  # pytest shows it with the failure
        raise
    finally:
        job.close()
        follower.join(5)
        kube.kubectl("-n", env.namespace, "delete", "trainingjob", name, "--wait=false", check=False)


def _apply(kube: Kube, body: dict[str, Any]) -> None:
    kubectl(kube, "apply", "-f", "-", stdin=json.dumps(body))


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def losses(events: list[dict[str, Any]]) -> dict[int, float]:
    """Loss per step; a step run again after a restart keeps its last value."""
    return {int(e["step"]): float(e["loss"]) for e in of_kind(events, "step")}


def assert_losses_match(got: dict[int, float], reference: dict[int, float]) -> None:
    for step, loss in sorted(got.items()):
        assert math.isclose(loss, reference[step], rel_tol=0.0, abs_tol=LOSS_ATOL), (
            f"step {step}: {loss} != {reference[step]} (uninterrupted run)"
        )


def nodes_of(pods: list[dict[str, Any]]) -> set[str]:
    return {p["spec"].get("nodeName", "") for p in pods} - {""}
