"""The operator's small Kubernetes edge: the only module that calls the API server.

Children are created with the field manager `topotrain` and a controller owner
reference; the Service and ConfigMap are server-side applied, but never onto an
object of that name owned by someone else (ForeignObject); pods are created if
absent (AlreadyExists is success only when the pod there is this job's, by
owner UID) and released by removing their scheduling gate; the status
subresource is patched with a JSON patch computed against what was last
written (status_patch.py), only onto the resourceVersion the pass read. Pod
deletes carry uid/resourceVersion preconditions and relabels test the label
they change (StaleWrite when refused). Every write first calls `Kube.fence`,
which raises when this replica does not hold the leader Lease (leader.py).
Calls are blocking (the official client); the async handlers run them in worker threads.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException as ApiException  # re-exported: see below

from topotrain import GROUP, PLURAL, TEMPLATE_PLURAL, VERSION
from topotrain.controller import apicalls
from topotrain.controller.apicalls import CONNECTIONS, WORKERS, api_message, bounded_map, drain
from topotrain.controller.status_patch import status_patch
from topotrain.core.kueue import KUEUE_GROUP, KUEUE_VERSION
from topotrain.core.manifests import FIELD_OWNER
from topotrain.core.ownership import ForeignObject, controller_owner, foreign_message, owned_by
from topotrain.core.rank_table import RankTable, parse_rank_table, rank_table_name

log = logging.getLogger("topotrain.kube")
T = TypeVar("T")
# The other modules of the controller catch ApiException from here (the only client import).
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"  # the resyncs' LISTs


class StaleWrite(ApiException):
    """The API server refused a write as stale: the object changed since the pass read it (409),
    or a pod's attempt label is no longer the one the pass saw. The pass ends; the next one
    decides again from fresh state."""

    def __init__(self, what: str, exc: ApiException) -> None:
        super().__init__(status=exc.status, reason=f"{what}: {api_message(exc)}")

    def __str__(self) -> str:
        return f"{self.status}: {self.reason}"


def load_config() -> None:
    """In-cluster service account, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]


REQUEST_TIMEOUT = (5.0, 30.0)  # seconds (connect, read) of every API call the operator makes


class TimedApiClient(client.ApiClient):
    """An ApiClient whose calls never wait for ever: a connection caught by an API server
    restart would otherwise block that job's reconcile loop for good."""

    def call_api(self, method: str, url: str, header_params: Any = None, body: Any = None,
                 post_params: Any = None, _request_timeout: Any = None) -> Any:
        return super().call_api(method, url, header_params, body, post_params,
                                _request_timeout if _request_timeout is not None else REQUEST_TIMEOUT)


def api_client() -> TimedApiClient:
    """The operator's client, on the loaded configuration, with CONNECTIONS kept alive."""
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = CONNECTIONS
    return TimedApiClient(configuration)


class Kube:
    """Typed calls for the handful of API operations the operator makes."""

    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.networking = client.NetworkingV1Api(self.api)
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="topotrain-kube")
        # Called before every write: raises NotLeader when this replica may not act (leader.py).
        self.fence: Callable[[], None] = lambda: None

    # --- the TrainingJob -----------------------------------------------------

    def patch_status(self, namespace: str, name: str, old: Mapping[str, Any],
                     new: Mapping[str, Any], uid: str | None = None,
                     resource_version: str | None = None) -> str:
        """Write status `new` over `old` (what the object holds), on the object `uid` only: a
        namesake re-created meanwhile, or a phase other than `old`'s (another writer moved the
        job), fails the patch's test (422) and is left untouched; a `resource_version` that is
        no longer the object's raises StaleWrite (409). Returns the object's resourceVersion."""
        self.fence()
        try:
            written = self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name,
                status_patch(old, new, uid, resource_version),
                field_manager=FIELD_OWNER, _content_type="application/json-patch+json",
            )
        except ApiException as exc:
            if exc.status == 409:
                raise StaleWrite(f"TrainingJob {namespace}/{name} changed since it was read", exc) from None
            raise
        return str((cast(dict[str, Any], written).get("metadata") or {}).get("resourceVersion") or "")

    def job_template(self, name: str) -> dict[str, Any] | None:
        """TrainingJobTemplate `name` (cluster-scoped); None when it does not exist."""
        return _unless_absent(lambda: cast(dict[str, Any], self.custom.get_cluster_custom_object(
            GROUP, VERSION, TEMPLATE_PLURAL, name)))

    # --- children ------------------------------------------------------------

    def existing(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The wire (camelCase) metadata of a Pod, Service, ConfigMap, NetworkPolicy or Deployment;
        None when absent."""
        read = {
            "Pod": self.core.read_namespaced_pod, "Service": self.core.read_namespaced_service,
            "ConfigMap": self.core.read_namespaced_config_map,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
            "Deployment": client.AppsV1Api(self.api).read_namespaced_deployment,
        }[kind]
        obj = _unless_absent(lambda: read(name, namespace))
        return None if obj is None else self.wire_metadata(obj)

    def wire_metadata(self, obj: Any) -> dict[str, Any]:
        wire = self.api.sanitize_for_serialization(obj.metadata)  # type: ignore[no-untyped-call]
        return cast(dict[str, Any], wire)

    def apply(self, manifest: Mapping[str, Any]) -> None:
        """Server-side apply a Service or ConfigMap as field manager `topotrain`, onto our own only.

        Raises ForeignObject when an object of that name exists and its controller is not the
        manifest's owner: a user's object is never taken over. Only our own is applied with
        force (to win back fields someone edited).
        """
        self.fence()
        kind, meta = manifest["kind"], manifest["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        ours = controller_owner(meta)
        uid, job = (ours.uid, ours.name) if ours else ("", "")
        current = self.existing(kind, namespace, name)
        if current is not None and not owned_by(current, uid):
            raise ForeignObject(kind, namespace, name, controller_owner(current), job)
        patch = {
            "Service": self.core.patch_namespaced_service,
            "ConfigMap": self.core.patch_namespaced_config_map,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
        }[kind]
        try:
            patch(
                name, namespace, dict(manifest), field_manager=FIELD_OWNER, force=current is not None,
                _content_type="application/apply-patch+yaml",
            )
        except ApiException as exc:
            if exc.status != 409 or current is not None:
                raise
            # created by someone else since we looked, with fields that clash with ours
            raise ForeignObject(kind, namespace, name, None, job) from None

    def apply_all(self, manifests: list[dict[str, Any]]) -> None:
        """`apply` each of `manifests` in parallel; the first one's error is raised when all ran."""
        if len(manifests) == 1:
            self.apply(manifests[0])
        else:
            bounded_map(self.pool, self.apply, manifests)

    def create_pods(self, manifests: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
        """Create pods (in parallel): (names that exist afterwards, refused name -> API message).
        A busy API server's answer (apicalls.TRANSIENT) is tried again before it is a refusal."""
        refused: dict[str, str] = {}

        def one(manifest: dict[str, Any]) -> str | None:
            meta, tries = manifest["metadata"], apicalls.CREATE_TRIES
            while True:
                tries -= 1
                self.fence()
                try:
                    drain(self.core.create_namespaced_pod(
                        meta["namespace"], cast(Any, manifest), field_manager=FIELD_OWNER, _preload_content=False,
                    ))
                    return str(meta["name"])
                except ApiException as exc:
                    if exc.status == 409:  # (also a retried create whose first try did land)
                        return self._created_by_us(manifest, refused)
                    again, message = exc.status in apicalls.TRANSIENT and tries > 0, api_message(exc)
                    log.warning("creating pod %s/%s: %s %s%s", meta["namespace"], meta["name"], exc.status,
                                message, "; trying again" if again else "")
                    if not again:
                        refused[str(meta["name"])] = f"{exc.status}: {message}"
                        return None
                time.sleep(apicalls.CREATE_RETRY_SECONDS)

        created = [name for name in bounded_map(self.pool, one, manifests) if name is not None]
        return created, refused

    def _created_by_us(self, manifest: dict[str, Any], refused: dict[str, str]) -> str | None:
        """After a 409: the name, if the pod there is ours (an earlier pass made it); else refused.

        A pod of the same name owned by anything else (a deleted job's terminating pod, a
        user's pod) is never adopted.
        """
        meta = manifest["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
        ours = controller_owner(meta)
        current = self.existing("Pod", namespace, name)
        if current is not None and ours is not None and owned_by(current, ours.uid):
            return name
        if current is None:  # deleted since: the next pass creates it
            refused[name] = f"409: pod {namespace}/{name} was being deleted; retrying"
        else:
            refused[name] = "409: " + foreign_message(
                "Pod", namespace, name, controller_owner(current), ours.name if ours else "",
                terminating=bool(current.get("deletionTimestamp")))
        log.warning("creating pod %s/%s: %s", namespace, name, refused[name])
        return None

    def pod_uids(self, namespaces: tuple[str, ...], *, cached: bool, page: int = 500) -> set[str]:
        """The uids of every pod in `namespaces` (empty: cluster-wide), `metadata_list`'s."""
        return {uid for namespace in namespaces or (None,)
                for uid in self.metadata_list("pods", namespace, cached=cached, page=page)}  # fmt: skip

    def metadata_list(self, plural: str, namespace: str | None, *, cached: bool,
                      page: int = 500) -> dict[str, str]:
        """uid -> name of every pod or node (in `namespace`; None: all), one LIST, paged, as
        metadata only (PartialObjectMetadataList: no spec or status, a fraction of a pod's bytes).
        `cached`: from the API server's watch cache (resourceVersion=0, cheap), else consistent."""
        found: dict[str, str] = {}
        kw: dict[str, Any] = {"limit": page, "_preload_content": False, "_headers": {"Accept": METADATA_LIST}}
        if cached:
            kw["resource_version"] = "0"
        while True:
            every: Callable[..., Any] = (self.core.list_node if plural == "nodes"
                                         else self.core.list_pod_for_all_namespaces)  # fmt: skip
            resp: Any = self.core.list_namespaced_pod(namespace, **kw) if namespace is not None else every(**kw)
            body = json.loads(resp.data)  # (_preload_content=False: the raw response)
            if body.get("kind") != "PartialObjectMetadataList":
                raise RuntimeError(f"LIST {plural} answered {body.get('kind')!r}, not metadata only")
            found.update((str(o["metadata"]["uid"]), str(o["metadata"].get("name"))) for o in body.get("items") or [])
            kw["_continue"] = (body.get("metadata") or {}).get("continue")
            if not kw["_continue"]:
                return found

    # The pod calls below return the names the API server answered 404 for (no such pod now):
    # the caller leaves them out of its watch cache (snapshot.Ghosts).

    def each_pod(self, names: list[str], call: Callable[[str], object],
                  tolerated: tuple[int, ...] = ()) -> list[str]:
        """`call(name)` for every name, in parallel; the names answered 404, in order. Other
        errors raise, except the statuses in `tolerated`."""

        def one(name: str) -> str | None:
            self.fence()
            try:
                call(name)
            except ApiException as exc:
                if exc.status == 404:
                    return name
                if exc.status not in tolerated:
                    raise
            return None

        return [n for n in bounded_map(self.pool, one, names) if n is not None]

    def release_pods(self, namespace: str, names: list[str]) -> list[str]:
        """Remove the gang scheduling gate from every pod, together (422: already released)."""
        return self.each_pod(names, lambda name: drain(self.core.patch_namespaced_pod(
            name, namespace, [{"op": "remove", "path": "/spec/schedulingGates"}],
            field_manager=FIELD_OWNER, _content_type="application/json-patch+json", _preload_content=False,
        )), tolerated=(422,))

    def patch_pods(self, namespace: str, names: list[str], patch: Mapping[str, Any]) -> list[str]:
        """The same JSON merge patch on each pod's metadata (a pod gone meanwhile is skipped)."""
        return self.each_pod(names, lambda name: drain(self.core.patch_namespaced_pod(
            name, namespace, dict(patch), field_manager=FIELD_OWNER,
            _content_type="application/merge-patch+json", _preload_content=False,
        )))

    def delete_pods(self, namespace: str, names: list[str], grace_seconds: int,
                    seen: Mapping[str, tuple[str, str]] | None = None) -> list[str]:
        """Delete pods; those in `seen` (name -> (uid, resourceVersion)) only if they are still
        that version of that pod (else StaleWrite: the pod changed since the pass read it)."""
        def one(name: str) -> None:
            known = (seen or {}).get(name)
            # every option in the body: beside one the API server ignores the query's (its grace)
            pre = known and client.V1Preconditions(uid=known[0], resource_version=known[1] or None)
            body = client.V1DeleteOptions(grace_period_seconds=grace_seconds,
                                          propagation_policy="Background", preconditions=pre)
            try:
                drain(self.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False))
            except ApiException as exc:
                if exc.status == 409 and known is not None:
                    raise StaleWrite(f"pod {namespace}/{name} changed since it was read", exc) from None
                raise

        return self.each_pod(names, one)

    def rank_table(self, namespace: str, job: str, uid: str | None = None) -> RankTable | None:
        """The job's rank table; with `uid`, raises ForeignObject when another owns the ConfigMap."""
        name = rank_table_name(job)
        try:
            cm = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        if uid is not None:
            meta = self.wire_metadata(cm)
            if not owned_by(meta, uid):
                raise ForeignObject("ConfigMap", namespace, name, controller_owner(meta), job)
        # binaryData values arrive as the API's base64 text
        binary = {k: v.decode() if isinstance(v, bytes) else v for k, v in (cm.binary_data or {}).items()}
        parsed = parse_rank_table({**(cm.data or {}), **binary})
        return None if parsed is None else RankTable(*parsed)

    # --- Kueue (queue_link.py) -------------------------------------------------

    def workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._custom_get(namespace, name, "workloads")

    def local_queue(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._custom_get(namespace, name, "localqueues")

    def create_workload(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create the job's Workload; AlreadyExists returns the one there (the caller checks
        whose it is)."""
        meta = manifest["metadata"]
        self.fence()
        try:
            return cast(dict[str, Any], self.custom.create_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, meta["namespace"], "workloads", dict(manifest),
                field_manager=FIELD_OWNER))
        except ApiException as exc:
            if exc.status != 409:
                raise
        found = self.workload(meta["namespace"], meta["name"])
        if found is None:
            raise RuntimeError(f"Workload {meta['namespace']}/{meta['name']} exists and then does not")
        return found

    def delete_workload(self, namespace: str, name: str, uid: str) -> None:
        """Delete the Workload `uid` (a namesake created meanwhile stays; gone is fine)."""
        self._delete_custom(uid, (KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name))

    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        """Delete TrainingJob `uid` (its children go by their owner references)."""
        self._delete_custom(uid, (GROUP, VERSION, namespace, PLURAL, name))

    def _delete_custom(self, uid: str, path: tuple[str, str, str, str, str]) -> None:
        self.fence()
        try:
            self.custom.delete_namespaced_custom_object(
                *path,
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
                propagation_policy="Background")
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def patch_workload(self, namespace: str, name: str, patch: Mapping[str, Any],
                       status: bool = False) -> None:
        """A JSON merge patch on the Workload (its status subresource with `status`)."""
        self.fence()
        call = (self.custom.patch_namespaced_custom_object_status if status
                else self.custom.patch_namespaced_custom_object)
        call(KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name, dict(patch),
             field_manager=FIELD_OWNER, _content_type="application/merge-patch+json")

    def resource_flavor(self, name: str) -> dict[str, Any] | None:
        return _unless_absent(lambda: cast(dict[str, Any], self.custom.get_cluster_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, "resourceflavors", name)))

    def priority_value(self, name: str) -> int | None:
        """The value of PriorityClass `name`; None when it does not exist."""
        return _unless_absent(
            lambda: int(client.SchedulingV1Api(self.api).read_priority_class(name).value or 0))

    def _custom_get(self, namespace: str, name: str, plural: str) -> dict[str, Any] | None:
        return _unless_absent(lambda: cast(dict[str, Any], self.custom.get_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, namespace, plural, name)))


def _unless_absent(call: Callable[[], T]) -> T | None:
    """`call()`, or None when the API server says the object does not exist (404)."""
    try:
        return call()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
