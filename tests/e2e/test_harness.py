"""The pod process harness on the real API server and KWOK nodes.

KWOK marks pods Running but runs nothing; the harness (testbed.harness, not a
kubelet) runs their container commands as local processes and reports their
exits as the pods' status. These tests pin down what the end-to-end tests
rely on: the pod's own command and environment run, exit codes come back as
pod status and KWOK leaves that status alone, deleted pods and failed nodes
stop their processes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed import faults
from testbed.harness import JOB_LABEL, PodProcessHarness
from testbed.kube import Kube
from testbed.nodes import add_node, delete_node, wait_nodes_ready
from testbed.procs import wait_until

PRINT_ENV = (
    "import json, os, sys; "
    "keys = ['SECRET', 'CONFIG', 'POD', 'NODE', 'MASTER_ADDR', 'MASTER_PORT', 'EXPANDED']; "
    "print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True); "
    "sys.exit(int(os.environ.get('EXIT', '0')))"
)
SLEEP = "import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.2)"


@pytest.fixture
def node(kube: Kube) -> Iterator[str]:
    """A KWOK GPU node of this test's own, so node faults touch no other test."""
    name = add_node(kube.kubeconfig, f"harness-{uuid.uuid4().hex[:6]}", gpus=2)
    wait_nodes_ready(kube.kubeconfig, [name], timeout=60)
    yield name
    delete_node(kube.kubeconfig, name)


def _pod(
    name: str, node: str, code: str, env: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {JOB_LABEL: "harness-test", "topotrain.io/attempt": "0"},
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "trainer",
                    "image": "example.invalid/trainer:0",
                    "command": ["python", "-c", code],
                    "env": env or [],
                }
            ],
        },
    }


def _status(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    raw = kube.core.read_namespaced_pod(name, namespace, _preload_content=False).data
    status: dict[str, Any] = json.loads(raw)["status"]
    return status


def _terminated(status: dict[str, Any]) -> dict[str, Any] | None:
    for container in status.get("containerStatuses") or []:
        state: dict[str, Any] | None = container.get("state", {}).get("terminated")
        if state:
            return state
    return None


def _wait_phase(kube: Kube, namespace: str, name: str, phase: str) -> dict[str, Any]:
    wait_until(
        lambda: _status(kube, namespace, name).get("phase") == phase,
        timeout=60,
        what=f"pod {name} {phase}",
    )
    return _status(kube, namespace, name)


def _passes(harness: PodProcessHarness, count: int) -> None:
    """Let the harness (and KWOK, which reacts within a pass) do `count` more passes."""
    for _ in range(count):
        harness.sync_once()


def test_pod_command_runs_with_resolved_env_and_exit_code_becomes_status(
    kube: Kube, namespace: str, node: str, harness: PodProcessHarness
) -> None:
    kube.core.create_namespaced_secret(
        namespace, {"metadata": {"name": "creds"}, "stringData": {"key": "s3cr3t"}}
    )
    kube.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "cfg"}, "data": {"v": "from-configmap"}}
    )
    env: list[dict[str, Any]] = [
        {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "key"}}},
        {"name": "CONFIG", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "v"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "MASTER_ADDR", "value": "job-0.job.ns.svc"},
        {"name": "MASTER_PORT", "value": "29500"},
        {"name": "EXPANDED", "value": "pod=$(POD)"},
        {"name": "EXIT", "value": "3"},
    ]
    kube.core.create_namespaced_pod(namespace, _pod("fails", node, PRINT_ENV, env))

    status = _wait_phase(kube, namespace, "fails", "Failed")
    terminated = _terminated(status)
    assert (
        terminated is not None and terminated["exitCode"] == 3 and terminated["reason"] == "Error"
    )
    _passes(harness, 3)
    assert _status(kube, namespace, "fails")["phase"] == "Failed", (
        "KWOK must not overwrite the reported exit"
    )

    printed = _env_line(harness.job_logs(namespace, "harness-test"))
    assert printed["SECRET"] == "s3cr3t" and printed["CONFIG"] == "from-configmap"
    assert printed["POD"] == "fails" and printed["NODE"] == node
    assert printed["EXPANDED"] == "pod=fails"
    # The headless Service name resolves to this machine; the port is the job attempt's own.
    assert printed["MASTER_ADDR"] == "127.0.0.1"
    assert printed["MASTER_PORT"] != "29500"


def _env_line(logs: list[Path]) -> dict[str, Any]:
    for path in logs:
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                parsed: dict[str, Any] = json.loads(line)
                return parsed
    raise AssertionError(f"no JSON line in {logs}")


def test_exit_zero_reports_succeeded(
    kube: Kube, namespace: str, node: str, harness: PodProcessHarness
) -> None:
    kube.core.create_namespaced_pod(namespace, _pod("ok", node, "print('done')"))
    terminated = _terminated(_wait_phase(kube, namespace, "ok", "Succeeded"))
    assert (
        terminated is not None
        and terminated["exitCode"] == 0
        and terminated["reason"] == "Completed"
    )


def test_deleting_the_pod_stops_its_processes(
    kube: Kube, namespace: str, node: str, harness: PodProcessHarness
) -> None:
    kube.core.create_namespaced_pod(namespace, _pod("sleeper", node, SLEEP))
    wait_until(
        lambda: len(harness.running(namespace)) == 1, timeout=60, what="the process to start"
    )
    pid = harness.running(namespace)[0].pgid

    kube.core.delete_namespaced_pod("sleeper", namespace)
    wait_until(
        lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid),
        timeout=30,
        what="the process to stop",
    )
    assert harness.running(namespace) == []


def test_hang_freezes_processes_with_the_pod_still_running(
    kube: Kube, namespace: str, node: str, harness: PodProcessHarness
) -> None:
    kube.core.create_namespaced_pod(namespace, _pod("hangs", node, SLEEP))
    wait_until(
        lambda: len(harness.running(namespace)) == 1, timeout=60, what="the process to start"
    )
    pid = harness.running(namespace)[0].pgid

    assert harness.freeze(namespace, "harness-test") == 1
    wait_until(lambda: _state(pid) == "T", timeout=10, what="the process to stop")
    _passes(harness, 2)
    assert _status(kube, namespace, "hangs")["phase"] == "Running"
    harness.thaw(namespace, "harness-test")


def test_node_failure_kills_processes_and_recovery_reports_them_lost(
    kube: Kube, namespace: str, node: str, harness: PodProcessHarness
) -> None:
    kube.core.create_namespaced_pod(namespace, _pod("victim", node, SLEEP))
    wait_until(
        lambda: len(harness.running(namespace)) == 1, timeout=60, what="the process to start"
    )
    pid = harness.running(namespace)[0].pgid

    faults.node_not_ready(kube.kubeconfig, node)
    wait_until(
        lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid),
        timeout=60,
        what="the process to die",
    )
    assert _status(kube, namespace, "victim")["phase"] == "Running", "a dead node reports nothing"

    faults.node_ready(kube.kubeconfig, node)
    terminated = _terminated(_wait_phase(kube, namespace, "victim", "Failed"))
    assert terminated is not None and terminated["exitCode"] == 137
    assert terminated["reason"] == "ContainerStatusUnknown"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _zombie(pid: int) -> bool:
    return _state(pid) in ("Z", "X", "gone")
