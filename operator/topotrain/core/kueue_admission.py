"""Running under Kueue, pure: an admitted Workload read back, and what the operator does with it.

`admission_of` reads Kueue's decision off the job's Workload (built by `kueue.py`); `gate`
turns it into the `QueueGate` the reconciler obeys (wait, run, or stop after an eviction);
`admitted_data` is the data degree a partial admission allows; `release_status` gives an
evicted Workload's quota back as Kueue's own job controllers do; `assigned_hosts` and
`within_assignment` follow Kueue's topology assignment (TAS) down to the nodes, `lost_assigned`
names the assigned nodes a gang can no longer use, and `hand_back_status` evicts the Workload so
Kueue assigns it anew. The I/O is controller/queue_link.py's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.validation import limits_for
from topotrain.core.elastic import bounds, pods_for, valid_degrees
from topotrain.core.kueue import POD_SET, QUEUE_LABEL
from topotrain.placement.topology import GPU_RESOURCE, Inventory

# Workload condition types (Kueue's apis/kueue/v1beta2/workload_types.go).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"

# "ClusterQueue cq-a doesn't exist", "Quota reserved in ClusterQueue cq-a", but not the
# English of "the ClusterQueue is stopped".
_NAMED_CLUSTER_QUEUE = re.compile(
    r"\bClusterQueue\s+(?!(?:is|was|for|with|without|to|and|or|the|selector)\b)"
    r"([a-z0-9](?:[-a-z0-9.]*[a-z0-9])?)"
)


@dataclass(frozen=True)
class QueueGate:
    """Kueue's word on a job sent to a LocalQueue (controller/queue_link.py reads it off the Workload).

    `admitted`: the gang may run (on the admitted flavor's nodes, at the admitted size, which
    the caller applied to the spec and the planner already). `evicted`: Kueue took the
    admission back (a preemption, a deactivation, ...) and the gang must stop. `message`: why
    the job waits or was evicted, naming the ClusterQueue where Kueue says which.
    """

    admitted: bool
    evicted: bool = False
    message: str = ""
    reason: str = ""  # Kueue's own reason of the eviction (Preempted, ...)

    @property
    def holds(self) -> bool:
        """The gang must not run now."""
        return self.evicted or not self.admitted


@dataclass(frozen=True)
class Admission:
    """What Kueue decided about a Workload, as the operator acts on it.

    `count`: pods admitted (below the podSet's count after a partial admission); None
    while no quota is reserved. `reason`/`message`: the condition that explains the
    state, the eviction first, then admission, then quota reservation.
    """

    admitted: bool
    quota_reserved: bool
    cluster_queue: str | None
    flavors: tuple[str, ...]
    count: int | None
    evicted: bool
    reason: str | None = None
    message: str | None = None


def admission_of(workload: Mapping[str, Any], resource: str = GPU_RESOURCE) -> Admission | None:
    """Read Kueue's decision from a Workload; None when Kueue has written no status yet.

    `flavors` are the ResourceFlavors assigned to `resource` (the GPUs), in assignment
    order without repeats.
    """
    status = workload.get("status")
    if not status:
        return None
    conditions = _conditions(status)
    admission = status.get("admission") or {}
    assignments = _worker_assignments(admission)
    flavors = dict.fromkeys(
        str(flavor) for a in assignments if (flavor := (a.get("flavors") or {}).get(resource))
    )
    evicted = _is_true(conditions, EVICTED)
    quota_reserved = _is_true(conditions, QUOTA_RESERVED)
    reason, message = _explanation(conditions, evicted, quota_reserved)
    return Admission(
        admitted=_is_true(conditions, ADMITTED),
        quota_reserved=quota_reserved,
        cluster_queue=admission.get("clusterQueue") or None,
        flavors=tuple(flavors),
        count=_admitted_count(workload, assignments) if admission else None,
        evicted=evicted,
        reason=reason,
        message=message,
    )


def pending_message(workload: Mapping[str, Any], cluster_queue: str | None = None) -> str:
    """The TrainingJob condition message while Kueue has not admitted the job.

    It names the ClusterQueue when Kueue's QuotaReserved message (or a reservation) names
    one, since that is where quota is missing or misconfigured, else `cluster_queue` (the
    one the job's LocalQueue points at, read by the caller); failing both, the LocalQueue
    the job was submitted to, the only queue the job's owner may be able to see. With quota
    reserved but the job not admitted, Kueue's Admitted message says what is still missing.
    """
    status = workload.get("status") or {}
    conditions = _conditions(status)
    reserved = conditions.get(QUOTA_RESERVED, {})
    detail = str(reserved.get("message") or "not yet considered by Kueue")
    named = _NAMED_CLUSTER_QUEUE.search(detail)
    if _is_true(conditions, QUOTA_RESERVED) and conditions.get(ADMITTED, {}).get("message"):
        detail = f"{detail}; {conditions[ADMITTED]['message']}"  # e.g. admission checks not ready
    cluster_queue = (named.group(1) if named else (status.get("admission") or {}).get("clusterQueue")
                     or cluster_queue)
    if cluster_queue:
        where = f"ClusterQueue {cluster_queue}"
    else:
        spec = workload.get("spec") or {}
        labels = (workload.get("metadata") or {}).get("labels") or {}
        where = f"LocalQueue {spec.get('queueName') or labels.get(QUEUE_LABEL) or '(none)'}"
    return f"waiting for Kueue admission in {where}: {detail}"


def _conditions(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in status.get("conditions") or []}


def _is_true(conditions: Mapping[str, Mapping[str, Any]], kind: str) -> bool:
    return conditions.get(kind, {}).get("status") == "True"


def condition_true(workload: Mapping[str, Any], kind: str) -> bool:
    """Whether the Workload's condition `kind` is True."""
    return _is_true(_conditions(workload.get("status") or {}), kind)


def _worker_assignments(admission: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The `workers` podSet's assignments; all of them for a Workload built elsewhere."""
    every: Sequence[Mapping[str, Any]] = admission.get("podSetAssignments") or []
    ours = [a for a in every if a.get("name") == POD_SET]
    return ours or list(every)


def _admitted_count(workload: Mapping[str, Any], assignments: list[Mapping[str, Any]]) -> int:
    """Admitted pods; an assignment without `count` admits the podSet's full count (Kueue's
    documented fallback for Workloads admitted before the field existed)."""
    pod_sets = {p.get("name"): p for p in (workload.get("spec") or {}).get("podSets") or []}
    total = 0
    for assignment in assignments:
        count = assignment.get("count")
        if count is None:
            count = pod_sets.get(assignment.get("name"), {}).get("count", 0)
        total += int(count)
    return total


def _explanation(
    conditions: Mapping[str, Mapping[str, Any]], evicted: bool, quota_reserved: bool,
) -> tuple[str | None, str | None]:
    """Reason and message of the condition that explains the Workload's state."""
    if evicted:
        eviction = conditions[EVICTED]
        message = str(eviction.get("message") or "")
        preemption = conditions.get(PREEMPTED, {})
        detail = str(preemption.get("message") or "")
        if _is_true(conditions, PREEMPTED) and detail and detail != message:
            message = f"{message}; {detail}" if message else detail
        return eviction.get("reason"), message or None
    for kind in ((ADMITTED, QUOTA_RESERVED) if quota_reserved else (QUOTA_RESERVED,)):
        if kind in conditions:
            return conditions[kind].get("reason"), conditions[kind].get("message")
    return None, None


# --- acting on Kueue's decision (controller/queue_link.py does the I/O) -------------------------

REQUEUED = "Requeued"
# Kueue's eviction reason when a node of a topology assignment failed and no replacement was
# found (v1beta2 WorkloadEvictedDueToNodeFailures); the operator's hand-back uses it too.
NODE_FAILURES = "NodeFailures"
# Evictions after which Kueue's own job controllers mark the Workload Requeued=True, so it
# goes back to its queue at once; after any other (a deactivation, a stopped queue) it waits.
_REQUEUE_REASONS = ("Preempted", NODE_FAILURES)


def gate(workload: Mapping[str, Any], resource: str = GPU_RESOURCE,
         cluster_queue: str | None = None) -> QueueGate:
    """What the reconciler needs of Kueue's decision: may the gang run, must it stop, and why
    (`cluster_queue`: the job's LocalQueue's, for the message while it waits)."""
    admission = admission_of(workload, resource)
    if admission is None or not (admission.admitted or admission.evicted):
        return QueueGate(admitted=False, message=pending_message(workload, cluster_queue))
    where = f"ClusterQueue {admission.cluster_queue}" if admission.cluster_queue else "its ClusterQueue"
    if admission.evicted:
        why = f"{admission.reason}: {admission.message}" if admission.message else str(admission.reason)
        return QueueGate(admitted=admission.admitted, evicted=True, reason=str(admission.reason or ""),
                         message=f"evicted by Kueue from {where} ({why})")
    flavors = ", ".join(admission.flavors) or "no GPU flavor"
    return QueueGate(admitted=True, message=f"admitted by Kueue in {where} (flavor {flavors}, "
                     f"{admission.count} pods)")


def admitted_data(spec: TrainingJobSpec, pods: int | None) -> int | None:
    """The data degree Kueue's admission of `pods` pods allows: the job's own degree when all of
    them were admitted, else the largest allowed degree (elastic.valid_degrees) that fits a
    partial admission; None when none fits (Kueue admitted fewer than minCount: never expected)."""
    par, per_pod = spec.parallelism, spec.worker.gpus_per_pod
    if pods is None or pods >= pods_for(par, par.data, per_pod):
        return par.data
    low, high = bounds(par)
    fitting = [d for d in valid_degrees(par, per_pod, low, high, limits_for(spec))
               if pods_for(par, d, per_pod) <= pods]
    return fitting[0] if fitting else None


def release_status(workload: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The status merge patch that gives an evicted Workload's quota back once its gang is gone,
    as Kueue's own job controllers do: QuotaReserved and Admitted False, no admission, and
    Requeued True after a preemption or node failures (so Kueue queues it again at once)."""
    status = workload.get("status") or {}
    conditions = {str(c.get("type")): dict(c) for c in status.get("conditions") or []}
    evicted = conditions.get(EVICTED, {})
    message = str(evicted.get("message") or "evicted")[:32768]
    generation = (workload.get("metadata") or {}).get("generation")

    def put(kind: str, value: bool, reason: str) -> None:
        old = conditions.get(kind, {})
        wanted = "True" if value else "False"
        changed = old.get("status") != wanted
        conditions[kind] = {
            "type": kind, "status": wanted, "reason": reason, "message": message,
            "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
            **({"observedGeneration": generation} if generation is not None else {}),
        }

    put(REQUEUED, evicted.get("reason") in _REQUEUE_REASONS, str(evicted.get("reason") or "Evicted"))
    put(QUOTA_RESERVED, False, "Pending")
    if ADMITTED in conditions:
        put(ADMITTED, False, "NoReservation")
    return {"status": {"admission": None, "conditions": list(conditions.values())}}


def flavor_node_labels(flavors: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The node labels of the admitted ResourceFlavors: the operator plans only on nodes that
    carry them (one GPU flavor per podSet in practice; with several, nodes must match all)."""
    labels: dict[str, str] = {}
    for flavor in flavors:
        labels.update({str(k): str(v) for k, v in ((flavor.get("spec") or {}).get("nodeLabels") or {}).items()})
    return labels


# --- following Kueue's topology assignment --------------------------------------------------

# Any of Kueue's TAS podset annotations marks a pod as placed by topology-aware scheduling:
# Kueue then counts its GPUs through the Workload's assignment only, not once more as a
# "non-TAS" pod on its node (Kueue's pkg/util/tas IsTAS).
TAS_POD_ANNOTATION = "kueue.x-k8s.io/podset-preferred-topology"


def assigned_hosts(workload: Mapping[str, Any], host_label: str) -> dict[str, int] | None:
    """Pods per node in Kueue's topology assignment of the `workers` podSet; None when there is
    none or its levels stop above the node (`host_label` not among them)."""
    admission = (workload.get("status") or {}).get("admission") or {}
    hosts: dict[str, int] = {}
    found = False
    for assignment in _worker_assignments(admission):
        topology = assignment.get("topologyAssignment") or {}
        levels = list(topology.get("levels") or [])
        if host_label not in levels:
            continue
        found = True
        at = levels.index(host_label)
        for values, pods in topology_domains(topology):
            hosts[values[at]] = hosts.get(values[at], 0) + pods
    return hosts if found else None


def topology_domains(topology: Mapping[str, Any]) -> list[tuple[list[str], int]]:
    """(values of each level, pods) per domain, from v1beta2's compact `slices` (each level's
    values and the pod counts given once for all its domains (`universal`) or per domain
    (`individual`: prefix + root + suffix)), or the older list of `domains`."""
    out = [([str(v) for v in d.get("values") or []], int(d.get("count") or 0))
           for d in topology.get("domains") or []]
    for chunk in topology.get("slices") or []:
        count = int(chunk.get("domainCount") or 0)
        columns = [_level_values(level, count) for level in chunk.get("valuesPerLevel") or []]
        pods = chunk.get("podCounts") or {}
        each = ([int(c) for c in pods["individual"]] if pods.get("individual")
                else [int(pods.get("universal") or 0)] * count)
        out += [([column[i] for column in columns], each[i]) for i in range(count)]
    return out


def _level_values(level: Mapping[str, Any], count: int) -> list[str]:
    if level.get("universal") is not None:
        return [str(level["universal"])] * count
    individual = level.get("individual") or {}
    prefix, suffix = str(individual.get("prefix") or ""), str(individual.get("suffix") or "")
    return [f"{prefix}{root}{suffix}" for root in individual.get("roots") or []]


def within_assignment(inventory: Inventory, hosts: Mapping[str, int], gpus_per_pod: int) -> Inventory:
    """The inventory cut down to Kueue's assigned nodes, each with room for the pods Kueue put
    there and no more: the operator's planner then orders the ranks on exactly the GPUs Kueue
    accounted for (its TP groups, pipeline stages and data replicas mapped to those nodes)."""
    nodes = {name: replace(info, free=min(info.free, hosts[name] * gpus_per_pod))
             for name, info in inventory.nodes.items() if name in hosts}
    excluded = {**inventory.excluded, **{
        name: "not in Kueue's topology assignment" for name in inventory.nodes if name not in hosts}}
    # `known` keeps every node for the planner's sense of place (a lost node anchors where its
    # replacement goes), but with no free GPU outside the cut: the incremental re-plan reads it.
    known = {name: nodes.get(name) or replace(info, free=0) for name, info in inventory.known.items()}
    return Inventory(nodes=nodes, excluded=excluded, known=known)


def lost_assigned(inventory: Inventory, hosts: Mapping[str, int],
                  avoided: frozenset[str] = frozenset()) -> dict[str, str]:
    """The nodes of Kueue's topology assignment the gang can no longer use, and why: gone from
    the cluster, not Ready, cordoned, a taint it does not tolerate (the inventory's reason), or
    avoided after failing the job's pods. Nodes whose GPUs are merely taken are not lost."""
    lost: dict[str, str] = {}
    for name in sorted(hosts):
        if name in inventory.nodes:
            continue
        if name in avoided:
            lost[name] = "avoided: it failed this job's pods"
        else:
            lost[name] = inventory.excluded.get(name) or "no longer in the cluster"
    return lost


def hand_back_status(workload: Mapping[str, Any], message: str, now: str) -> dict[str, Any]:
    """The status merge patch that hands an admitted Workload back to Kueue, as Kueue itself
    evicts one whose assigned node failed with no replacement: Evicted True, reason NodeFailures,
    `message` (naming the lost node), and no unhealthy nodes left for Kueue to replace. The gang
    then stops as for any eviction and `release_status` clears the admission with Requeued True,
    so Kueue admits the job again with a new topology assignment. The patch carries the
    Workload's resourceVersion: a Workload Kueue changed meanwhile is not overwritten (the API
    server refuses it, and the next pass decides again)."""
    status = workload.get("status") or {}
    meta = workload.get("metadata") or {}
    conditions = [dict(c) for c in status.get("conditions") or [] if c.get("type") != EVICTED]
    evicted: dict[str, Any] = {"type": EVICTED, "status": "True", "reason": NODE_FAILURES,
                               "message": message[:32768], "lastTransitionTime": now}
    if meta.get("generation") is not None:
        evicted["observedGeneration"] = meta["generation"]
    patch: dict[str, Any] = {"status": {"conditions": [*conditions, evicted], "unhealthyNodes": None}}
    if meta.get("resourceVersion"):
        patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    return patch
