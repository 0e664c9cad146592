"""Fault injection on the testbed, through real mechanisms only.

- Pod failure: KWOK's own chaos stage `pod-container-running-failed`. The
  pod gets its label and annotations; KWOK (as the kubelet would) writes the
  container's terminated state with the exit code and reason, phase Failed.
- Node NotReady: KWOK's chaos stage `node-not-ready` makes the "kubelet"
  report Ready=False; the real kube-controller-manager then taints the node
  `node.kubernetes.io/not-ready`.
- Node unreachable: the node's Lease (kube-node-lease) is taken over by a
  holder that never renews it. KWOK, which only plays kubelets whose leases
  it holds, then neither renews the lease nor writes the node's or its pods'
  status; after the node-monitor grace period the real
  kube-controller-manager marks the node Unknown and taints it
  `node.kubernetes.io/unreachable`, as for a machine that died.
- Node deletion: the Node object is deleted (`testbed.nodes.delete_node`).
- S3 outage: the versitygw process is stopped and started again.
- Trainer crash or hang inside a pod the harness runs: a signal to the pod's
  trainer ranks only (`signal_trainer`), the children of its supervisor
  process, so the pod itself stays up.
"""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client
from topotrain_trainer._procname import SPARE_COMM

from testbed.client import api_client, core_v1
from topotrain_sdk.forker import FORKER_COMM

POD_FAILED_STAGE = "pod-container-running-failed.stage.kwok.x-k8s.io"
NODE_NOT_READY_STAGE = "node-not-ready.stage.kwok.x-k8s.io"
NODE_LEASE_NAMESPACE = "kube-node-lease"
SILENT_HOLDER = "topotrain-testbed/unreachable"


def fail_pod(
    kubeconfig: Path | str,
    namespace: str,
    name: str,
    *,
    exit_code: int = 1,
    reason: str = "Error",
    message: str = "injected by the topotrain testbed",
    container: str | None = None,
) -> None:
    """Make a Running pod's container terminate with `exit_code` (all containers unless `container`)."""
    annotations = {
        f"{POD_FAILED_STAGE}/exit-code": str(exit_code),
        f"{POD_FAILED_STAGE}/reason": reason,
        f"{POD_FAILED_STAGE}/message": message,
    }
    if container:
        annotations[f"{POD_FAILED_STAGE}/container-name"] = container
    patch = {"metadata": {"labels": {POD_FAILED_STAGE: "true"}, "annotations": annotations}}
    with api_client(kubeconfig) as api:
        core_v1(api).patch_namespaced_pod(name, namespace, patch)


def _patch_node(kubeconfig: Path | str, name: str, patch: dict[str, Any]) -> None:
    with api_client(kubeconfig) as api:
        core_v1(api).patch_node(name, patch)


def node_not_ready(
    kubeconfig: Path | str, name: str, *, reason: str = "KubeletNotReady", message: str = "injected"
) -> None:
    """The node's kubelet (KWOK) reports Ready=False until `node_ready`."""
    _patch_node(
        kubeconfig,
        name,
        {
            "metadata": {
                "labels": {NODE_NOT_READY_STAGE: "true"},
                "annotations": {
                    f"{NODE_NOT_READY_STAGE}/reason": reason,
                    f"{NODE_NOT_READY_STAGE}/message": message,
                },
            }
        },
    )


def node_ready(kubeconfig: Path | str, name: str) -> None:
    """Undo `node_not_ready` and `node_unreachable`: KWOK reports the node Ready again."""
    _patch_node(
        kubeconfig,
        name,
        {
            "metadata": {
                "labels": {NODE_NOT_READY_STAGE: None},
                "annotations": {
                    f"{NODE_NOT_READY_STAGE}/reason": None,
                    f"{NODE_NOT_READY_STAGE}/message": None,
                },
            }
        },
    )
    with api_client(kubeconfig) as api:
        leases: Any = client.CoordinationV1Api(api)
        lease = leases.read_namespaced_lease(name, NODE_LEASE_NAMESPACE)
    if lease.spec.holder_identity == SILENT_HOLDER:
        # An expired lease: KWOK acquires it on its next try and resumes the node.
        long_ago = datetime.now(UTC) - timedelta(days=1)
        _patch_lease(kubeconfig, name, long_ago, duration_seconds=1)


def node_unreachable(kubeconfig: Path | str, name: str) -> None:
    """Silence the node's kubelet (KWOK): no more lease renewals or status updates."""
    _patch_lease(kubeconfig, name, datetime.now(UTC), duration_seconds=7 * 24 * 3600)


def node_reachable(kubeconfig: Path | str, name: str, lease_seconds: int) -> None:
    """Undo `node_unreachable` before the grace period ends (a flap): the lease renewed now and
    held by nobody, so the controller manager sees a live node and KWOK takes the lease on its
    next try. The change of holder is what makes KWOK manage the node again and re-list its
    pods, as a kubelet resyncs after a partition; handing the lease straight back to KWOK's own
    identity left pods deleted or created meanwhile unhandled for minutes."""
    _patch_lease(kubeconfig, name, datetime.now(UTC), duration_seconds=lease_seconds, holder=None)


def _patch_lease(
    kubeconfig: Path | str, name: str, renew_time: datetime, duration_seconds: int,
    holder: str | None = SILENT_HOLDER,
) -> None:
    patch = {
        "spec": {
            "holderIdentity": holder,
            "renewTime": renew_time.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "leaseDurationSeconds": duration_seconds,
        }
    }
    with api_client(kubeconfig) as api:
        client.CoordinationV1Api(api).patch_namespaced_lease(name, NODE_LEASE_NAMESPACE, patch)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                    out.append(int(entry.name))
    return sorted(out)


def _is_python(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        argv0 = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0]
        return Path(argv0.decode(errors="replace")).name.startswith("python")
    return False


def trainer_processes(pod_pid: int) -> list[int]:
    """The trainer ranks of a harness-run pod: the children of its supervisor.

    The supervisor is the pod's process, or, when the image's entrypoint starts an init first
    (`tini -- python -m topotrain_trainer`, wherever tini is installed), that init's only
    child: signalling the init's children would stop the supervisor and leave the ranks be.
    """
    supervisor = pod_pid
    while not _is_python(supervisor):
        below = _children(supervisor)
        if len(below) != 1:
            return []
        supervisor = below[0]
    # a supervisor's warm spares (training.warmSpares) are not ranks until they take an attempt;
    # forked ranks (topotrain_sdk.forker) are the children of the pod's forker, which is no rank
    ranks = []
    for pid in _children(supervisor):
        comm = _comm(pid)
        if comm == FORKER_COMM:
            ranks.extend(_children(pid))
        elif comm != SPARE_COMM:
            ranks.append(pid)
    return ranks


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def signal_trainer(pod_pid: int, sig: signal.Signals = signal.SIGKILL) -> list[int]:
    """Signal every trainer rank of a pod (SIGKILL: a crash; SIGSTOP: a hang); their pids."""
    ranks = trainer_processes(pod_pid)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return ranks
