"""Which checkpoint endpoints the operator sends requests to.

The operator reads every job's checkpoint store itself (the resume step, the heartbeat),
from its own network position. Without a limit, `spec.checkpoint.endpoint` lets any user
who can create a TrainingJob make the operator send requests wherever they like: to its
own ports on 127.0.0.1, to a cloud metadata address, to hosts only the operator's network
reaches. So a job's endpoint must be on the allowlist:

- in-cluster Service names: hosts ending in `.svc` or `.svc.cluster.local`;
- the operator's own default endpoint (TOPOTRAIN_S3_ENDPOINT, Helm `s3.endpoint`), by host
  and port;
- the entries of TOPOTRAIN_CHECKPOINT_ENDPOINTS (Helm `s3.allowedEndpoints`): `host`
  (any port), `host:port`, `*.suffix` (any host under it) or `*` (any endpoint, the
  behaviour before the allowlist).

A job that names no endpoint uses the default one (or the AWS S3 endpoint boto3 derives),
which is always allowed. Another endpoint is refused before any request is made: ConfigValid
False with reason CheckpointEndpointNotAllowed naming `spec.checkpoint.endpoint`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

IN_CLUSTER_SUFFIXES = (".svc", ".svc.cluster.local")


def _host_port(url: str) -> tuple[str, int] | None:
    """(host, port) of an http(s) URL; None when it is not one."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname.lower().rstrip("."), port or (443 if parts.scheme == "https" else 80)


def _matches(entry: str, host: str, port: int) -> bool:
    entry = entry.strip().lower()
    if entry == "*":
        return True
    if entry.startswith("*."):
        return host.endswith(entry[1:])
    if entry.startswith("["):  # an IPv6 literal, with or without a port
        literal, _, rest = entry[1:].partition("]")
        return host == literal and (not rest or rest == f":{port}")
    name, _, wanted = entry.partition(":")
    return host == name and (not wanted or wanted == str(port))


def endpoint_problem(endpoint: str, default: str | None, extra: tuple[str, ...]) -> str | None:
    """Why the operator may not send requests to `endpoint` (a job's spec.checkpoint.endpoint);
    None when it may."""
    where = _host_port(endpoint)
    if where is None:
        return f"spec.checkpoint.endpoint {endpoint!r} is not an http:// or https:// URL with a host"
    host, port = where
    if host.endswith(IN_CLUSTER_SUFFIXES) or any(_matches(e, host, port) for e in extra):
        return None
    if default and _host_port(default) == where:
        return None
    allowed = ", ".join(["*.svc", "*.svc.cluster.local", *([default] if default else []), *extra])
    return (f"spec.checkpoint.endpoint {endpoint!r} is not among the checkpoint endpoints this "
            f"operator may reach ({allowed}); the operator sent it no request. Name an in-cluster "
            f"Service, or ask the cluster's admin to add it to the chart value s3.allowedEndpoints")
