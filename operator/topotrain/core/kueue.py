"""Running under Kueue, pure: a TrainingJob as a Kueue `Workload`, and an admitted one read back.

Kueue decides *whether* and *where* a gang may run; the operator still creates and
places the pods. So the Workload here is the one object Kueue needs to queue, admit,
preempt and account the gang: one podSet `workers` whose pod template carries what
Kueue counts (GPUs, extra resources) and what picks a ResourceFlavor (nodeSelector,
tolerations, the acceptable GPU products), plus a Topology-Aware-Scheduling request
derived from the parallelism.

API version: `kueue.x-k8s.io/v1beta2`, the storage version of Workload and Topology in
Kueue v0.17 (v1beta1 is still served there, marked deprecated). In v1beta2 the queue is
`spec.queueName` and the priority is `spec.priorityClassRef` plus `spec.priority`, which
Kueue requires together; so the caller reads the PriorityClass's value and passes it.

The topology request, in the node label keys of `TopologyLevels` (the ones
`topology_manifest` puts in the Topology, so they match):

- the whole gang is *preferred* inside one block: Kueue packs it as tightly as it fits;
- tensor Required and a TP group spans several pods: each group of `tensor/gpusPerPod`
  pods is a slice *required* inside one NVLink domain;
- otherwise, pipeline or data Required: the pods that must share a rack
  (`placement.Mesh.rack_units`, the same grouping the operator's own planner uses)
  form a slice required inside one rack.

Kueue v0.17 takes one slice layer (the multi-layer form is behind an alpha gate), so a
multi-pod TP group wins over a Required pipeline/data rack. A slice is only a count to
Kueue: which pod indices make up each slice is the operator's choice when it maps the
assignment onto pods. Nodes missing a value for any Topology level are invisible to
Kueue's TAS; on clusters without NVLink cliques point the NVLink label at the hostname.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.api.validation import limits_for
from topotrain.core.elastic import bounds, pods_for, valid_degrees
from topotrain.core.manifests import CONTAINER, JobMeta, owner_reference
from topotrain.core.reconcile import QueueGate
from topotrain.placement.request import GangRequest, Mesh
from topotrain.placement.topology import GPU_RESOURCE, Inventory, TopologyLevels

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_API_VERSION = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
POD_SET = "workers"
NAME_PREFIX = "trainingjob-"
MAX_NAME = 63  # a DNS label: Kueue copies the Workload name into label values
HASH_LENGTH = 8

# Workload condition types (Kueue's apis/kueue/v1beta2/workload_types.go).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# "ClusterQueue cq-a doesn't exist", "Quota reserved in ClusterQueue cq-a", but not the
# English of "the ClusterQueue is stopped".
_NAMED_CLUSTER_QUEUE = re.compile(
    r"\bClusterQueue\s+(?!(?:is|was|for|with|without|to|and|or|the|selector)\b)"
    r"([a-z0-9](?:[-a-z0-9.]*[a-z0-9])?)"
)


def workload_name(job_name: str) -> str:
    """`trainingjob-<job>`, or, when that is too long or not a DNS label, a truncated form
    ending in a hash of the job name: the same job always maps to the same Workload (so a
    restarted operator finds it), and two long names sharing a prefix never collide."""
    candidate = NAME_PREFIX + job_name
    if len(candidate) <= MAX_NAME and _DNS_LABEL.match(candidate):
        return candidate
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:HASH_LENGTH]
    safe = re.sub(r"[^a-z0-9-]", "-", candidate.lower())
    head = safe[: MAX_NAME - HASH_LENGTH - 1].rstrip("-")
    return f"{head}-{digest}"


def workload_for(
    job_name: str,
    namespace: str,
    uid: str,
    spec: TrainingJobSpec,
    queue_name: str,
    levels: TopologyLevels,
    *,
    priority: int | None = None,
) -> dict[str, Any]:
    """The Workload that queues this job in LocalQueue `queue_name`.

    Its count is the job's pods at its desired data degree; with an elastic job
    (minData < data) minCount is the pods at minData, so Kueue's partial admission can
    start the job smaller rather than not at all. Owned by the TrainingJob (controller),
    so deleting the job releases the quota. `priority` is the value of the spec's
    PriorityClass, which Kueue v1beta2 needs next to the reference; a spec naming a class
    without it raises ValueError, since Kueue would refuse the object.
    """
    request = GangRequest.from_spec(spec)
    pod_set: dict[str, Any] = {
        "name": POD_SET,
        "count": request.pods(),
        "template": pod_template(spec, levels),
        "topologyRequest": topology_request(spec, levels, request),
    }
    if request.lowest_data < request.data:
        pod_set["minCount"] = request.pods(request.lowest_data)
    workload_spec: dict[str, Any] = {"queueName": queue_name, "podSets": [pod_set]}
    class_name = spec.worker.priority_class_name
    if class_name:
        if priority is None:
            raise ValueError(
                f"spec.worker.priorityClassName {class_name!r}: Kueue needs the PriorityClass's "
                "value in spec.priority; read it and pass priority="
            )
        workload_spec["priorityClassRef"] = {
            "group": "scheduling.k8s.io", "kind": "PriorityClass", "name": class_name,
        }
        workload_spec["priority"] = priority
    metadata = {
        "name": workload_name(job_name),
        "namespace": namespace,
        "labels": {QUEUE_LABEL: queue_name},
        "ownerReferences": [owner_reference(JobMeta(job_name, namespace, uid))],
    }
    return {"apiVersion": KUEUE_API_VERSION, "kind": "Workload", "metadata": metadata,
            "spec": workload_spec}


def pod_template(spec: TrainingJobSpec, levels: TopologyLevels) -> dict[str, Any]:
    """What Kueue reads of a pod: the resources it counts against quota and the scheduling
    fields it matches ResourceFlavors with. The acceptable GPU products become a required
    node affinity, so Kueue only assigns a flavor of a pool the job accepts (their
    preference order is the ClusterQueue's flavor order, not the job's)."""
    worker = spec.worker
    gpus = str(worker.gpus_per_pod)
    extra = worker.resources
    requests = {**((extra.requests or {}) if extra else {}), levels.gpu_resource: gpus}
    limits = {**((extra.limits or {}) if extra else {}), levels.gpu_resource: gpus}
    container = {"name": CONTAINER, "image": spec.image,
                 "resources": {"requests": requests, "limits": limits}}
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if worker.node_selector:
        pod_spec["nodeSelector"] = dict(worker.node_selector)
    if worker.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in worker.tolerations]
    if worker.gpu_types:
        term = {"matchExpressions": [
            {"key": levels.product, "operator": "In", "values": list(worker.gpu_types)},
        ]}
        pod_spec["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]},
        }}
    if worker.priority_class_name:
        pod_spec["priorityClassName"] = worker.priority_class_name
    return {"spec": pod_spec}


def topology_request(
    spec: TrainingJobSpec, levels: TopologyLevels, request: GangRequest | None = None,
) -> dict[str, Any]:
    """The podSet's TAS request (see the module docstring for the rules and their limits).

    The gang is only *preferred* in a block: requiring it would leave a job that fits the
    cluster but no single block pending forever, while the operator's own placement
    already scores block spread. No `podIndexLabel`: only Kueue's own ungater reads it,
    and the operator, not Kueue, releases these pods.
    """
    request = request or GangRequest.from_spec(spec)
    out: dict[str, Any] = {"preferred": levels.block}
    required_slice = slice_requirement(request, levels)
    if required_slice is not None:
        out["podSetSliceRequiredTopology"], out["podSetSliceSize"] = required_slice
    return out


def slice_requirement(request: GangRequest, levels: TopologyLevels) -> tuple[str, int] | None:
    """(node label, pods per slice) for the one slice layer Kueue takes, or None.

    A one-pod group needs no slice: a pod never spans nodes. Groups are read from the
    same `Mesh` the planner uses, so Kueue and the operator agree on what must stay
    together. Should the rack groups ever differ in size, the whole gang is the slice:
    stricter, but never weaker than what the spec requires.
    """
    mesh = Mesh.build(request)
    if request.tensor_topology == "Required" and mesh.unit_size > 1:
        return levels.nvlink, mesh.unit_size
    if "Required" not in (request.pipeline_topology, request.data_topology):
        return None
    sizes = {len(unit) for unit in mesh.rack_units}
    size = sizes.pop() if len(sizes) == 1 else mesh.pods
    return (levels.rack, size) if size > 1 else None


def topology_manifest(name: str, levels: TopologyLevels) -> dict[str, Any]:
    """A Kueue `Topology` with the operator's levels, outermost first: block, rack, NVLink
    domain, host. A label configured for two levels (the NVLink label pointed at the
    hostname on clusters without cliques) appears once, as Kueue requires unique levels."""
    labels = dict.fromkeys((levels.block, levels.rack, levels.nvlink, levels.host))
    return {
        "apiVersion": KUEUE_API_VERSION, "kind": "Topology", "metadata": {"name": name},
        "spec": {"levels": [{"nodeLabel": label} for label in labels]},
    }


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


# --- acting on Kueue's decision (handlers_queue.py does the I/O) -------------------------

REQUEUED = "Requeued"
# Evictions after which Kueue's own job controllers mark the Workload Requeued=True, so it
# goes back to its queue at once; after any other (a deactivation, a stopped queue) it waits.
_REQUEUE_REASONS = ("Preempted", "NodeFailures")


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
    return Inventory(nodes=nodes, excluded=excluded, known=inventory.known)
