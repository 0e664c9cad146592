"""The operator's small Kubernetes edge: the only module that calls the API server.

Children are created with the field manager `topotrain` and a controller owner
reference; the Service and ConfigMap are server-side applied; pods are created
if absent (AlreadyExists is success) and released by removing their scheduling
gate; the status subresource is patched with a JSON merge patch computed
against what was last written, and only when it differs. Calls are blocking
(the official client); the async handlers run them in worker threads.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from topotrain import GROUP, PLURAL, VERSION
from topotrain.contract import ACCESS_KEY_ID, SECRET_ACCESS_KEY
from topotrain.manifests import FIELD_OWNER, parse_rank_table, rank_table_name
from topotrain.reconcile import RankTable
from topotrain.status import Reason

log = logging.getLogger("topotrain.kube")
WORKERS = 16  # parallel pod creates/deletes: a 512-pod gang in well under a second


class SecretProblem(Exception):
    """The checkpoint Secret cannot be used; `reason` is a status Reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 JSON merge patch turning `old` into `new` (lists are replaced whole)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


def load_config() -> None:
    """In-cluster service account, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]


class Kube:
    """Typed calls for the handful of API operations the operator makes."""

    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="topotrain-kube")

    # --- the TrainingJob -----------------------------------------------------

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            job = cast(dict[str, Any], self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name
            ))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return job

    def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(patch)},
            field_manager=FIELD_OWNER,
        )

    # --- children ------------------------------------------------------------

    def apply(self, manifest: Mapping[str, Any]) -> None:
        """Server-side apply a Service or ConfigMap as field manager `topotrain`."""
        kind, meta = manifest["kind"], manifest["metadata"]
        patch = {
            "Service": self.core.patch_namespaced_service,
            "ConfigMap": self.core.patch_namespaced_config_map,
        }[kind]
        patch(
            meta["name"], meta["namespace"], dict(manifest), field_manager=FIELD_OWNER, force=True,
            _content_type="application/apply-patch+yaml",
        )

    def create_pods(self, manifests: list[dict[str, Any]]) -> list[str]:
        """Create pods (in parallel); returns the names that exist afterwards."""

        def one(manifest: dict[str, Any]) -> str | None:
            meta = manifest["metadata"]
            try:
                self.core.create_namespaced_pod(
                    meta["namespace"], cast(Any, manifest), field_manager=FIELD_OWNER
                )
            except ApiException as exc:
                if exc.status != 409:
                    log.warning("creating pod %s/%s: %s %s", meta["namespace"], meta["name"],
                                exc.status, exc.reason)
                    return None
            return str(meta["name"])

        return [name for name in self.pool.map(one, manifests) if name is not None]

    def release_pods(self, namespace: str, names: list[str]) -> None:
        """Remove the gang scheduling gate from every pod, together."""

        def one(name: str) -> None:
            try:
                self.core.patch_namespaced_pod(
                    name, namespace, [{"op": "remove", "path": "/spec/schedulingGates"}],
                    field_manager=FIELD_OWNER, _content_type="application/json-patch+json",
                )
            except ApiException as exc:
                if exc.status not in (404, 422):  # gone, or already released
                    raise

        list(self.pool.map(one, names))

    def delete_pods(self, namespace: str, names: list[str], grace_seconds: int) -> None:
        def one(name: str) -> None:
            try:
                self.core.delete_namespaced_pod(
                    name, namespace, grace_period_seconds=grace_seconds,
                    propagation_policy="Background",
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise

        list(self.pool.map(one, names))

    def rank_table(self, namespace: str, job: str) -> RankTable | None:
        try:
            cm = self.core.read_namespaced_config_map(rank_table_name(job), namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        parsed = parse_rank_table(cm.data or {})
        return None if parsed is None else RankTable(*parsed)

    # --- the checkpoint Secret -----------------------------------------------

    def checkpoint_credentials(self, namespace: str, secret: str) -> tuple[str, str]:
        """(access key, secret key) from the job's Secret; raises SecretProblem."""
        try:
            obj = self.core.read_namespaced_secret(secret, namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise SecretProblem(
                    Reason.SECRET_NOT_FOUND,
                    f"Secret {namespace}/{secret} (spec.checkpoint.credentialsSecret) does not exist",
                ) from None
            if exc.status == 403:
                raise SecretProblem(
                    Reason.SECRET_FORBIDDEN,
                    f"the operator may not read Secret {namespace}/{secret}: grant it `get` on that "
                    "Secret (Helm value rbac.checkpointSecrets) or name an allowed one",
                ) from None
            raise
        data = obj.data or {}
        missing = [k for k in (ACCESS_KEY_ID, SECRET_ACCESS_KEY) if not data.get(k)]
        if missing:
            raise SecretProblem(
                Reason.SECRET_INVALID, f"Secret {namespace}/{secret} lacks {', '.join(missing)}"
            )
        return (base64.b64decode(data[ACCESS_KEY_ID]).decode(),
                base64.b64decode(data[SECRET_ACCESS_KEY]).decode())
