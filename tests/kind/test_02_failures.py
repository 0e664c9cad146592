"""Failures on the real data plane: a worker node lost (its node container
stopped, so the real node lifecycle controller marks it NotReady) and a
trainer container killed inside its pod. Either way the operator must restart
the gang from the newest committed checkpoint and the job must Succeed with
the losses of an uninterrupted run."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Any

from topotrain.manifests import CONTAINER

from testbed.kube import Kube
from tests.kind.conftest import KindEnv, kubectl_json, wait_for
from tests.kind.jobs import (
    REFERENCE,
    STEPS,
    KindJob,
    assert_losses_match,
    losses,
    nodes_of,
    of_kind,
    running_job,
)


def _committed(job: KindJob) -> int:
    return int(job.status().get("checkpoint", {}).get("step") or 0)


def _node_ready(kube: Kube, node: str) -> str:
    conditions = kubectl_json(kube, "get", "node", node)["status"]["conditions"]
    return next(c["status"] for c in conditions if c["type"] == "Ready")


def _check_recovered(job: KindJob, lost_after: int) -> None:
    """Attempt 1 restored the newest committed step and every logged loss matches the reference."""
    events = job.events()
    assert 1 in events, f"no second attempt logged: {sorted(events)}"
    restored = of_kind(events[1], "restored")
    assert restored and int(restored[0]["step"]) >= lost_after, restored
    merged = {**losses(events[0]), **losses(events[1])}
    assert max(merged) == STEPS
    if REFERENCE:
        assert_losses_match(merged, REFERENCE)


def test_worker_node_stopped_gang_restarts_on_healthy_workers(
    kube: Kube, kind_env: KindEnv, bucket: str, tmp_path: Path
) -> None:
    # The node stays stopped for the rest of the session (NotReady, so nothing is placed
    # there); the two other workers hold a whole gang.
    with running_job(kube, kind_env, bucket, tmp_path, "nodeloss") as job:
        wait_for(lambda: _committed(job) >= 4, 600, "a committed checkpoint", every=1)
        first = job.seen_pods(attempt=0)
        lost = sorted(nodes_of(first))[0]
        committed = _committed(job)
        subprocess.run(["docker", "stop", "-t", "0", lost], check=True, capture_output=True)
        wait_for(lambda: _node_ready(kube, lost) != "True", 60, f"node {lost} NotReady")
        job.wait_phase("Succeeded")
        second = job.seen_pods(attempt=1)
        assert second, "the operator started no second attempt"
        assert lost not in nodes_of(second), nodes_of(second)
        assert job.status().get("restarts", 0) >= 1
        _check_recovered(job, committed)


def test_trainer_container_killed_gang_restarts(
    kube: Kube, kind_env: KindEnv, bucket: str, tmp_path: Path
) -> None:
    with running_job(kube, kind_env, bucket, tmp_path, "kill") as job:
        wait_for(lambda: _committed(job) >= 4, 600, "a committed checkpoint", every=1)
        committed = _committed(job)
        victim = next(p for p in job.pods(attempt=0) if p["metadata"]["labels"]["topotrain.io/index"] == "1")
        node, pod = victim["spec"]["nodeName"], victim["metadata"]["name"]
        # SIGKILL the container's main process from its node, as an OOM kill would
        cid = subprocess.run(
            ["docker", "exec", node, "crictl", "ps", "-q", "--name", CONTAINER, "--label",
             f"io.kubernetes.pod.name={pod}"], check=True, capture_output=True, text=True,
        ).stdout.split()[0]  # fmt: skip
        pid = subprocess.run(
            ["docker", "exec", node, "crictl", "inspect", "-o", "go-template", "--template",
             "{{.info.pid}}", cid], check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        subprocess.run(["docker", "exec", node, "kill", "-9", pid], check=True)

        def terminated() -> dict[str, Any] | None:
            with contextlib.suppress(subprocess.CalledProcessError):
                status = kubectl_json(kube, "-n", kind_env.namespace, "get", "pod", pod)["status"]
                state = status.get("containerStatuses", [{}])[0].get("state", {})
                return state.get("terminated")  # type: ignore[no-any-return]
            return {"exitCode": "pod deleted before its container status was read"}

        # restartPolicy Never: the kubelet reports the container killed (137) and the pod Failed
        dead = wait_for(terminated, 60, f"container of {pod} terminated", every=0.3)
        assert dead["exitCode"] == 137, dead
        job.wait_phase("Succeeded")
        assert job.status().get("restarts", 0) >= 1
        _check_recovered(job, committed)
