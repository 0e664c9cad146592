"""The checkpoint Secret's credentials, read through the operator's API client (kube.py)."""

from __future__ import annotations

import base64

from topotrain.api.status import Reason
from topotrain.contract import ACCESS_KEY_ID, SECRET_ACCESS_KEY
from topotrain.controller.kube import ApiException, Kube


class SecretProblem(Exception):
    """The checkpoint Secret cannot be used; `reason` is a status Reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def checkpoint_credentials(kube: Kube, namespace: str, secret: str) -> tuple[str, str]:
    """(access key, secret key) from the job's Secret; raises SecretProblem."""
    try:
        obj = kube.core.read_namespaced_secret(secret, namespace)
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
