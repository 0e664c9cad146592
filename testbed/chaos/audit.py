"""Who wrote what, from the API server's own audit log (not from the operator).

The soak's private testbed runs kube-apiserver with an audit policy (testbed.components
.audit_flags) that records, in the soak's namespace, every create/update/patch of a Lease
(with its body: the holder it writes) and every create/delete of a pod. Each operator
replica reaches the API server through a relay of its own bound to a loopback address of
its own (testbed.tcpproxy `source`), so an event's source IP names the replica; both
replicas use the chart's one ServiceAccount, so the user name could not.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any


def policy(namespace: str) -> str:
    """The audit policy (YAML) for a soak in `namespace`."""
    return f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Request
    namespaces: [{namespace}]
    verbs: [create, update, patch]
    resources: [{{group: coordination.k8s.io, resources: [leases]}}]
  - level: Metadata
    namespaces: [{namespace}]
    verbs: [create, delete, deletecollection]
    resources: [{{group: "", resources: [pods]}}]
  - level: None
"""


def replica_address(number: int) -> str:
    """The loopback address operator replica `number` (1000, 999, ...) connects from."""
    offset = 1000 - number
    return f"127.0.{10 + offset // 250}.{1 + offset % 250}"


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def event_record(event: dict[str, Any]) -> dict[str, Any] | None:
    """The few fields the checkers read, or None for an event of no interest."""
    ref = event.get("objectRef") or {}
    resource = ref.get("resource")
    if resource not in ("pods", "leases") or ref.get("subresource"):
        return None
    body = event.get("requestObject") or {}
    return {
        "received": _epoch(event["requestReceivedTimestamp"]),
        "done": _epoch(event.get("stageTimestamp") or event["requestReceivedTimestamp"]),
        "verb": event.get("verb"), "resource": resource,
        "name": ref.get("name") or (body.get("metadata") or {}).get("name"),
        "code": (event.get("responseStatus") or {}).get("code"),
        "source": (event.get("sourceIPs") or [None])[0],
        "user": (event.get("user") or {}).get("username"),
        "holder": (body.get("spec") or {}).get("holderIdentity") if resource == "leases" else None,
    }  # fmt: skip


def read(path: Path) -> list[dict[str, Any]]:
    """Every pod and Lease write in the audit log at `path` (empty when there is none)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a line cut by the API server's restart
            continue
        if event.get("stage") == "ResponseComplete" and (record := event_record(event)) is not None:
            out.append(record)
    return out
