"""Failures on the real data plane: a worker node frozen (its node container
paused, as a partition looks from the control plane) and lost (stopped), so
the real node lifecycle controller marks it NotReady, and a trainer container
killed inside its pod. Either way the operator must restart
the gang from the newest committed checkpoint and the job must Succeed with
the losses of an uninterrupted run."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Any

from topotrain.core.manifests import CONTAINER

from testbed.kube import Kube
from tests.kind.conftest import KindEnv, KubectlError, kubectl_json, service_nodes, wait_for
from tests.kind.jobs import (
    INTERVAL,
    REFERENCE,
    STEPS,
    KindJob,
    assert_losses_match,
    losses,
    nodes_of,
    of_kind,
    running_job,
)

# The first attempt holds at HOLD (training.holdAtStep, a test aid), a committed checkpoint and
# two steps on, until the test's fault stops it: the fault lands while the job trains, however
# fast the machine. The next attempt trains to the end.
HOLD = INTERVAL + 2


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


def _worker_to_lose(kube: Kube, kind_env: KindEnv, job: KindJob) -> str:
    """A worker holding part of the gang and none of the cluster's own services: losing the node
    that serves S3 or runs the operator is a different failure from the one these tests show."""
    lost = sorted(nodes_of(job.seen_pods(attempt=0)))[0]
    services = service_nodes(kube, kind_env)
    assert lost not in services.values(), f"{lost} runs cluster services too: {services}"
    return lost


def _gang_on_lost_node_restarts_elsewhere(kube: Kube, job: KindJob, lost: str, committed: int) -> None:
    """The node went NotReady through the node lifecycle controller; the next attempt runs on the
    other workers, restored the newest committed step, and the job Succeeded with the reference
    losses."""
    wait_for(lambda: _node_ready(kube, lost) != "True", 60, f"node {lost} NotReady")
    job.wait_phase("Succeeded")
    second = job.seen_pods(attempt=1)
    assert second, "the operator started no second attempt"
    assert lost not in nodes_of(second), nodes_of(second)
    assert job.status().get("restarts", 0) >= 1
    _check_recovered(job, committed)


def _pause(node: str, tries: int = 5) -> None:
    """`docker pause`, asked again when the kernel could not freeze the node's cgroup in time.
    With cgroup v1's freezer runc gives up ("unable to freeze") when a task does not stop within
    its retries, for example one in uninterruptible sleep on a loaded disk (CI, session 11: the
    first ask failed), and leaves the cgroup thawed: asking again is a clean second try."""
    errors = []
    for _ in range(tries):
        paused = subprocess.run(["docker", "pause", node], capture_output=True, text=True)
        if paused.returncode == 0:
            return
        errors.append(paused.stderr.strip())
        if "unable to freeze" not in paused.stderr:
            break
        time.sleep(2)
    raise AssertionError(f"docker pause {node}: {errors}")


def test_worker_node_paused_gang_restarts_on_healthy_workers(
    kube: Kube, kind_env: KindEnv, bucket: str, tmp_path: Path
) -> None:
    """`docker pause` freezes every process of a worker, as a network partition looks from the
    control plane: the kubelet stops renewing its lease, yet its containers, their sockets and
    their pods' API objects all stay. The gang's ranks on the other workers hang on their frozen
    peers; the operator must not wait on the frozen node's pods (their deletion cannot finish
    while the kubelet is frozen). The node is unpaused afterwards and must come back Ready."""
    with running_job(kube, kind_env, bucket, tmp_path, "pause", holdAtStep=HOLD) as job:
        wait_for(lambda: _committed(job) >= 4, 600, "a committed checkpoint", every=1)
        lost = _worker_to_lose(kube, kind_env, job)
        committed = _committed(job)
        _pause(lost)
        try:
            _gang_on_lost_node_restarts_elsewhere(kube, job, lost, committed)
        finally:
            subprocess.run(["docker", "unpause", lost], check=False, capture_output=True)
        # the kubelet resumes: its lease is renewed and the pods the operator deleted meanwhile go
        wait_for(lambda: _node_ready(kube, lost) == "True", 120, f"node {lost} Ready again")
        wait_for(lambda: not [p for p in job.pods(attempt=0) if p["spec"].get("nodeName") == lost], 180,
                 f"attempt 0's pods gone from {lost} once its kubelet runs again")  # fmt: skip


def test_trainer_container_killed_restarts_the_gang_in_place(
    kube: Kube, kind_env: KindEnv, bucket: str, tmp_path: Path
) -> None:
    with running_job(kube, kind_env, bucket, tmp_path, "kill", holdAtStep=HOLD) as job:
        wait_for(lambda: _committed(job) >= 4, 600, "a committed checkpoint", every=1)
        committed = _committed(job)
        gang = job.pods(attempt=0)
        victim = next(p for p in gang if p["metadata"]["labels"]["topotrain.io/index"] == "1")
        node, pod = victim["spec"]["nodeName"], victim["metadata"]["name"]
        healthy = {p["metadata"]["name"]: p["metadata"]["uid"] for p in gang if p is not victim}
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
            with contextlib.suppress(KubectlError):
                status = kubectl_json(kube, "-n", kind_env.namespace, "get", "pod", pod)["status"]
                state = status.get("containerStatuses", [{}])[0].get("state", {})
                return state.get("terminated")  # type: ignore[no-any-return]
            return {"exitCode": "pod deleted before its container status was read"}

        # restartPolicy Never: the kubelet reports the container killed (137) and the pod Failed
        dead = wait_for(terminated, 60, f"container of {pod} terminated", every=0.3)
        assert dead["exitCode"] == 137, dead
        job.wait_phase("Succeeded")
        assert job.status().get("restarts", 0) >= 1
        # an in-place restart (docs/operator.md): only the failed pod is replaced, the healthy
        # pods (same UIDs) run the next attempt's ranks
        second = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job.seen_pods(attempt=1)}
        assert healthy.items() <= second.items(), (healthy, second)
        assert pod not in second
        _check_recovered(job, committed)


def test_worker_node_stopped_gang_restarts_on_healthy_workers(
    kube: Kube, kind_env: KindEnv, bucket: str, tmp_path: Path
) -> None:
    # Last of the failure tests: the node stays stopped for the rest of the session (NotReady,
    # so nothing is placed there); the two other workers hold a whole gang.
    with running_job(kube, kind_env, bucket, tmp_path, "nodeloss", holdAtStep=HOLD) as job:
        wait_for(lambda: _committed(job) >= 4, 600, "a committed checkpoint", every=1)
        lost = _worker_to_lose(kube, kind_env, job)
        committed = _committed(job)
        subprocess.run(["docker", "stop", "-t", "0", lost], check=True, capture_output=True)
        _gang_on_lost_node_restarts_elsewhere(kube, job, lost, committed)
