"""kopf registrations of the topotrain operator, and `topotrain run`.

Only registrations live here; each delegates to a handler module. Indexes keep
a slim copy of every node and every GPU pod, so a reconcile pass never LISTs;
pod and node events wake the affected jobs' loops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from topotrain import GROUP, KIND, PLURAL, VERSION
from topotrain.controller import kopf_readiness
from topotrain.controller.apicalls import PASS_THREADS
from topotrain.controller.fleet import Fleet
from topotrain.controller.health import PASSES, HealthServer, LoopHealth
from topotrain.controller.indexes import (
    job_of,
    node_entries,
    pod_entries,
    requests_gpus,
    slim_node,
    slim_pod,
)
from topotrain.controller.kopf_diffbase import EmptyDiffBase, change_handlers
from topotrain.controller.kopf_finalizer import FINALIZER
from topotrain.controller.kube import ApiException, Kube, load_config
from topotrain.controller.leader import Elector, KubeLeases, Leadership, LeaderTiming
from topotrain.controller.loop import JobLoop
from topotrain.controller.metrics import METRICS
from topotrain.controller.process import Operator
from topotrain.controller.settings import Settings, SettingsError, add_arguments
from topotrain.core.kueue import KUEUE_GROUP, KUEUE_VERSION
from topotrain.core.ownership import controller_owner

log = logging.getLogger("topotrain")
SETTINGS: Settings = Settings.from_env()
STATE: dict[str, Operator] = {}
_NODE_SEEN: dict[str, tuple[Any, ...]] = {}
_GENERATION_SEEN: dict[str, Any] = {}  # TrainingJob uid -> the metadata.generation last seen


def _operator() -> Operator:
    if "op" not in STATE:
        STATE["op"] = Operator(settings=SETTINGS, kube=Kube(), fleet=Fleet(SETTINGS.labels))
    return STATE["op"]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    load_config()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    if changing := change_handlers():  # they would read EmptyDiffBase's empty diffs
        raise RuntimeError(f"change handlers {changing} need a diff base: see kopf_diffbase.py")
    settings.persistence.diffbase_storage = EmptyDiffBase()
    settings.posting.level = logging.INFO
    settings.posting.enabled = True
    settings.watching.server_timeout = 300
    # Serve exactly the configured namespaces and the CRDs present at startup: no RBAC on
    # namespaces or CRDs is needed, and no start-up delay retrying forbidden LISTs.
    settings.scanning.disabled = True
    # kopf's own peering is off: every replica watches, and the Lease (leader.py) decides which
    # one acts.
    settings.peering.standalone = True
    METRICS.serve(SETTINGS.metrics_port)
    _operator()
    log.info("topotrain operator: %s", SETTINGS)


# The index handlers are async, so they run in the event loop (a sync one takes a trip through
# kopf's thread pool for every event); they also keep the fleet's free-GPU counts, before kopf
# stores the object (fleet.py).
@kopf.index("nodes")
async def nodes_index(body: kopf.Body, **_: Any) -> dict[Any, Mapping[str, Any]]:
    slim = slim_node(body)
    if (op := STATE.get("op")) is not None and op.fleet is not None:
        op.fleet.node_seen(slim)
    return node_entries(slim)


@kopf.index("pods", when=lambda body, **_: requests_gpus(body))
async def gpu_pods_index(body: kopf.Body, **_: Any) -> dict[Any, Mapping[str, Any]]:
    slim = slim_pod(body)
    if (op := STATE.get("op")) is not None and op.fleet is not None:
        op.fleet.pod_seen(slim)
    return pod_entries(slim)


@kopf.on.event("pods", when=lambda body, **_: requests_gpus(body))
async def pod_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    # async: it runs in the event loop, where the loops' asyncio.Events may be set
    METRICS.watch_events.labels("pods").inc()
    op = STATE.get("op")
    if op is None:
        return
    key = job_of(body)
    if key is not None:
        op.wake(key)
    if type is None:  # from a LIST: after start-up, a re-list (process.py relisted)
        op.relisted()
    if type == "DELETED":
        op.ledger.deleted(body)  # created and deleted before any pass saw it
        if op.fleet is not None:
            op.fleet.pod_gone(body)
    phase = body.get("status", {}).get("phase")
    if type == "DELETED" or phase in ("Succeeded", "Failed") or body.get("metadata", {}).get("deletionTimestamp"):
        op.wake_for_capacity()  # GPUs are being freed: waiting jobs may fit now


@kopf.on.event("nodes")
async def node_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    METRICS.watch_events.labels("nodes").inc()
    op = STATE.get("op")
    if op is None:
        return
    slim = slim_node(body)
    name = str(slim["metadata"]["name"])
    if type is None:  # from a LIST: after start-up, a re-list (process.py relisted)
        op.relisted()
    if type == "DELETED" and op.fleet is not None:
        op.fleet.node_gone(name)
    ready = tuple(c.get("status") for c in slim["status"]["conditions"])
    seen = (type == "DELETED", ready, slim["spec"]["unschedulable"], len(slim["spec"]["taints"]),
            repr(sorted(slim["status"]["allocatable"].items())), repr(sorted(slim["metadata"]["labels"].items())))
    if _NODE_SEEN.get(name) != seen:
        _NODE_SEEN[name] = seen
        op.wake_for_node(name)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    """A spec change (a new metadata.generation: status writes leave it alone) wakes the job's
    loop at once instead of at its next idle re-check (reconcile_interval)."""
    METRICS.watch_events.labels("trainingjobs").inc()
    op = STATE.get("op")
    meta = body.get("metadata", {})
    uid = str(meta.get("uid") or "")
    if type == "DELETED":
        _GENERATION_SEEN.pop(uid, None)
        return
    generation = meta.get("generation")
    if op is None or _GENERATION_SEEN.get(uid) == generation:
        return
    first = uid not in _GENERATION_SEEN
    _GENERATION_SEEN[uid] = generation
    if not first:
        op.wake((str(meta.get("namespace") or "default"), str(meta.get("name"))))


def _owned_by_a_job(body: kopf.Body, **_: Any) -> bool:
    owner = controller_owner(body.get("metadata", {}))
    return owner is not None and owner.kind == KIND


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "workloads", when=_owned_by_a_job)
async def workload_event(body: kopf.Body, **_: Any) -> None:
    """Kueue admitted, evicted or requeued a job's Workload: wake that job's loop. (Without
    Kueue's CRDs at start-up kopf serves no such watch; passes still read the Workload.)"""
    op = STATE.get("op")
    owner = controller_owner(body.get("metadata", {}))
    if op is not None and owner is not None:
        op.wake((str(body.get("metadata", {}).get("namespace") or "default"), owner.name))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=2.0)
async def job_daemon(
    name: str, namespace: str | None, body: kopf.Body, stopped: kopf.DaemonStopped, **kwargs: Any,
) -> None:
    pods: kopf.Index[str, Any] = kwargs["gpu_pods_index"]  # kopf passes indexes by their names
    nodes: kopf.Index[str, Any] = kwargs["nodes_index"]
    await JobLoop(_operator(), (namespace or "default", name), body).run(stopped, pods, nodes)


def _lease_owner(kube: Kube, namespace: str, deployment: str) -> dict[str, Any] | None:
    """The ownerReference of the Deployment that owns the Lease (settings.lease_owner), or None:
    none named, or it cannot be read (then the Lease outlives the release, as before)."""
    if not deployment:
        return None
    try:
        found = kube.existing("Deployment", namespace, deployment)
    except ApiException as exc:
        found, why = None, f"{exc.status} {exc.reason}"
    else:
        why = "not found"
    if found is None or not found.get("uid"):
        log.warning("the Lease's owner, Deployment %s/%s, cannot be read (%s): the Lease will not be "
                    "deleted with it", namespace, deployment, why)
        return None
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment, "uid": found["uid"]}


def _leadership() -> Leadership | None:
    """The Lease this replica must hold to act, wired into the operator's writes; None when
    standalone (it always acts)."""
    load_config()
    op = _operator()
    if SETTINGS.standalone:
        METRICS.leader.set(1)
        return None
    timing = LeaderTiming(SETTINGS.lease_duration, SETTINGS.renew_deadline, SETTINGS.retry_period)
    store = KubeLeases(op.kube, SETTINGS.lease_home(), SETTINGS.lease_name, SETTINGS.renew_deadline / 2,
                       _lease_owner(op.kube, SETTINGS.lease_home(), SETTINGS.lease_owner))
    leadership = Leadership(Elector(store, SETTINGS.identity, timing), op.leadership_changed)
    op.leader, op.kube.fence = leadership, leadership.fence
    METRICS.leader.set(0)
    log.info("leader election: replica %s, Lease %s/%s (duration %gs, renew deadline %gs, retry %gs)",
             SETTINGS.identity, SETTINGS.lease_home(), SETTINGS.lease_name,
             timing.lease_duration, timing.renew_deadline, timing.retry_period)
    return leadership


def _run(args: argparse.Namespace) -> int:
    global SETTINGS
    SETTINGS = Settings.from_env().with_args(args)
    logging.basicConfig(
        level=logging.DEBUG if SETTINGS.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not SETTINGS.verbose:  # kopf reports every successful watch handler at INFO
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kopf_readiness.install()  # a fleet of thousands of nodes is listed in seconds, not minutes
    # /healthz from a thread of its own, judged by the event loop's heartbeat (controller/health.py):
    # kopf's endpoint shares the loop with every watch event and answered late on a busy fleet.
    health = LoopHealth(SETTINGS.liveness_stall_seconds, passes=PASSES,
                        pass_stall_seconds=SETTINGS.pass_stall_seconds)
    try:
        server = HealthServer(health, SETTINGS.health_port).start() if SETTINGS.health_port else None
    except OSError as err:
        raise SettingsError(f"health port {SETTINGS.health_port} (--health-port, "
                            f"TOPOTRAIN_HEALTH_PORT): {err.strerror or err}") from None

    async def operate() -> None:
        # asyncio.to_thread's pool, where every job's pass makes its blocking API and S3 calls
        # (the default is the CPU count + 4: 6 threads on two cores, queueing a new job's first
        # read behind a large gang's pod calls and the other jobs' passes)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(PASS_THREADS, thread_name_prefix="topotrain-pass"))
        heartbeat = asyncio.create_task(health.run(), name="topotrain-heartbeat")
        leadership = _leadership()
        election = asyncio.create_task(leadership.run(), name="topotrain-lease") if leadership else None
        try:
            await kopf.operator(clusterwide=SETTINGS.cluster_wide,
                                namespaces=list(SETTINGS.namespaces), standalone=True)
        finally:
            heartbeat.cancel()
            if election is not None and leadership is not None:
                election.cancel()
                await leadership.release()  # the standby takes over at once, not after expiry

    try:
        asyncio.run(operate())
    finally:
        if server is not None:
            server.stop()
    return 0


def add_run_parser(subparsers: Any) -> None:
    """`topotrain run`: registered by topotrain.cli.main."""
    parser = subparsers.add_parser(
        "run", help="run the operator (kopf) against $KUBECONFIG or the in-cluster API",
        description="Run the topotrain operator. Flags override TOPOTRAIN_* environment variables.",
    )
    add_arguments(parser)
    parser.set_defaults(func=_run)
