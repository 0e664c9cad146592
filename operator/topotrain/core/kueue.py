"""Running under Kueue, pure: a TrainingJob as a Kueue `Workload` (read back in kueue_admission.py).

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
from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.core.manifests import CONTAINER, JobMeta, owner_reference
from topotrain.core.multikueue import RUN_ANNOTATION
from topotrain.placement.request import GangRequest, Mesh
from topotrain.placement.topology import TopologyLevels

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_API_VERSION = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"  # Kueue's elastic workloads (kueue_slices.py)
REPLACES_ANNOTATION = "kueue.x-k8s.io/workload-slice-replacement-for"
POD_SET = "workers"
NAME_PREFIX = "trainingjob-"
MAX_NAME = 63  # a DNS label: Kueue copies the Workload name into label values
HASH_LENGTH = 8

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


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
    sliced: bool = False,
    name: str | None = None,
    replaces: str | None = None,
) -> dict[str, Any]:
    """The Workload that queues this job in LocalQueue `queue_name`.

    Its count is the job's pods at its desired data degree; with an elastic job
    (minData < data) minCount is the pods at minData, so Kueue's partial admission can
    start the job smaller rather than not at all, unless the job's resizes are `sliced`
    (kueue_slices.py: Kueue's elastic workloads, which it admits whole): then the Workload
    carries Kueue's elastic-job annotation, and a slice for a larger count is `name`d and
    says which Workload it `replaces` ("<namespace>/<name>"). Owned by the TrainingJob (controller),
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
    if request.lowest_data < request.data and not sliced:
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
    metadata = _metadata(JobMeta(job_name, namespace, uid), queue_name, sliced, replaces)
    metadata["name"] = name or workload_name(job_name)
    return {"apiVersion": KUEUE_API_VERSION, "kind": "Workload", "metadata": metadata,
            "spec": workload_spec}


def _metadata(job: JobMeta, queue_name: str, sliced: bool, replaces: str | None) -> dict[str, Any]:
    # The run's identity: MultiKueue's clone of this Workload on a worker cluster keeps it,
    # so every worker's copy of the job resumes the same run's checkpoints (multikueue.py).
    annotations = {RUN_ANNOTATION: job.uid}
    if sliced:
        annotations[ELASTIC_ANNOTATION] = "true"
    if replaces:
        annotations[REPLACES_ANNOTATION] = replaces
    return {"namespace": job.namespace, "labels": {QUEUE_LABEL: queue_name}, "annotations": annotations,
            "ownerReferences": [owner_reference(job)]}


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
