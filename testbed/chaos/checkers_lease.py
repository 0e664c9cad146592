"""Invariant 11, fenced pod writes: no pod is created or deleted by an operator replica that
did not hold the Lease at the time.

Judged from the API server's audit log (testbed.chaos.audit), not from the operator: the
Lease's holder at a moment is the holder written by the last successful Lease write the API
server completed before it; a pod create or delete the API server accepted from a replica
(known by the source address of its relay) when that replica was not the holder is a
violation. Writes the API server refused (a fenced replica's compare-and-swap failing) do not
count: they changed nothing.
"""

from __future__ import annotations

import bisect
from typing import Any

from testbed.chaos.timeline import Verdict, verdict

POD_WRITES = ("create", "delete", "deletecollection")


def holders(events: list[dict[str, Any]], lease: str) -> tuple[list[float], list[str]]:
    """(when, holder) of every successful write of the Lease `lease`, in completion order."""
    writes = sorted((e["done"], e["holder"] or "") for e in events
                    if e["resource"] == "leases" and e["name"] == lease and _accepted(e))  # fmt: skip
    return [t for t, _ in writes], [h for _, h in writes]


def _accepted(event: dict[str, Any]) -> bool:
    return isinstance(event.get("code"), int) and 200 <= event["code"] < 300


def check_fenced_pod_writes(replicas: list[dict[str, Any]], events: list[dict[str, Any]]) -> Verdict:
    """`replicas`: the rig's record of each replica started (number, identity, address, lease);
    `events`: the audit log's pod and Lease writes."""
    name = "11 no pod written by a replica not holding the Lease"
    by_address = {r["address"]: r["identity"] for r in replicas}
    leases = {r.get("lease") for r in replicas} - {None}
    if not by_address or not leases:
        return verdict(name, 0, [], ["no replica record or audit log: not judged"] if events else [])
    times, who = holders(events, next(iter(leases)))
    if not times:  # a standalone replica takes no Lease (or no audit log was kept)
        return verdict(name, 0, [], ["no Lease write in the audit log: not judged"])
    problems: list[str] = []
    checked = 0
    for event in sorted(events, key=lambda e: e["received"]):
        replica = by_address.get(event["source"])
        if event["resource"] != "pods" or event["verb"] not in POD_WRITES or replica is None:
            continue
        if not _accepted(event):
            continue
        checked += 1
        # the last Lease write the API server completed before it received this pod write
        index = bisect.bisect_right(times, event["received"]) - 1
        holder = who[index] if index >= 0 else None
        if holder != replica:
            done = "created" if event["verb"] == "create" else "deleted"
            problems.append(f"t={event['received']:.3f}: {replica} {done} pod {event['name']} "
                            f"while the Lease's holder was {holder or 'nobody'}")  # fmt: skip
    return verdict(name, checked, problems)
