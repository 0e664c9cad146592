"""What the pod process harness (`testbed.harness`) needs to start a pod's
container as a local process: its argv and its environment, resolved the way
a kubelet resolves them (`env`, `envFrom`, `valueFrom`, `$(VAR)` expansion).

Two deliberate differences from a kubelet, because every "node" of the
testbed is this one machine:

- `MASTER_ADDR` (the headless Service name of pod 0) is rewritten to
  127.0.0.1: there is no cluster DNS, and all ranks run here.
- `MASTER_PORT` is rewritten to a port chosen per (namespace, job, attempt),
  so two jobs (or an old and a new attempt of one job) never share a
  rendezvous port on 127.0.0.1.
- downwardAPI volumes (`downward_files`) are files in the pod's scratch
  directory, not mounts; the control volume's mount path
  (`topotrain.contract.CONTROL_DIR`) reaches the process as
  `TOPOTRAIN_CONTROL_DIR`. In the control file, `topotrain.io/master-addr`
  becomes 127.0.0.1 and `topotrain.io/master-port` the attempt's port, as in
  the environment.

The image is not pulled or run: the container's `command`, or the image's
entrypoint from `ENTRYPOINTS` when the pod has none, runs with this
machine's Python environment (the one running the harness).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from topotrain.contract import (
    ATTEMPT_ANNOTATION,
    MASTER_ADDR_ANNOTATION,
    MASTER_PORT_ANNOTATION,
    format_control,
)

from testbed.binaries import REPO_ROOT, code_path

MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
LOCAL_ADDR = "127.0.0.1"
# Variables the harness passes from its own environment (a container image
# would bring its own; ours is this machine's Python venv).
INHERITED = ("LANG", "LC_ALL", "TZ")


def _dockerfile_entrypoint(dockerfile: Path) -> list[str] | None:
    """The exec-form ENTRYPOINT + CMD of a Dockerfile, so the harness runs what the image would."""
    import json

    entrypoint: list[str] = []
    cmd: list[str] = []
    try:
        lines = dockerfile.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() in ("ENTRYPOINT", "CMD") and rest.strip().startswith("["):
            parsed = [str(part) for part in json.loads(rest)]
            if keyword.upper() == "ENTRYPOINT":
                entrypoint, cmd = parsed, []
            else:
                cmd = parsed
    return (entrypoint + cmd) or None


IMAGE_DOCKERFILES = {"trainer": "trainer_image/Dockerfile", "operator": "operator/Dockerfile"}
FALLBACK_ENTRYPOINTS = {
    "trainer": ["python", "-m", "topotrain_trainer"],
    "operator": ["topotrain", "run"],
}


def image_entrypoint(image: str) -> list[str]:
    """The argv a topotrain image starts with when the pod gives no command: the exec-form
    ENTRYPOINT + CMD of its Dockerfile in this repository. Other images are not known."""
    name = image.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
    for kind, dockerfile in IMAGE_DOCKERFILES.items():
        if kind in name:
            return _dockerfile_entrypoint(REPO_ROOT / dockerfile) or FALLBACK_ENTRYPOINTS[kind]
    raise ValueError(
        f"image {image!r}: the pod sets no command and the harness knows no entrypoint for it"
    )


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined variables are replaced, `$$` escapes, others stay."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(substitute, text)


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """A `fieldRef.fieldPath` of the pod (the paths the downward API supports)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    simple: dict[str, Any] = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise ValueError(f"fieldRef {path!r} is not supported by the harness")


ObjectReader = Callable[[str, str, str], dict[str, str] | None]
"""(kind "Secret"|"ConfigMap", namespace, name) -> its data (decoded), None if absent."""


def _ref_value(ref: Mapping[str, Any], data: dict[str, str] | None, kind: str) -> str | None:
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise LookupError(f"{kind} {ref.get('name')!r} key {ref['key']!r} not found")
    return data[ref["key"]]


def container_env(
    pod: Mapping[str, Any], container: Mapping[str, Any], read: ObjectReader
) -> dict[str, str]:
    """The container's environment as a kubelet builds it: envFrom first, then env in order."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix") or ""
        for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
            ref = source.get(key)
            if ref is None:
                continue
            data = read(kind, namespace, ref["name"])
            if data is None and not ref.get("optional"):
                raise LookupError(f"{kind} {ref['name']!r} (envFrom) not found")
            env.update({prefix + k: v for k, v in (data or {}).items()})
    for var in container.get("env") or []:
        value = _env_var_value(pod, var, read, env)
        if value is not None:
            env[var["name"]] = value
    return env


def _env_var_value(
    pod: Mapping[str, Any], var: Mapping[str, Any], read: ObjectReader, env: Mapping[str, str]
) -> str | None:
    source = var.get("valueFrom")
    if not source:
        return expand(str(var.get("value") or ""), env)
    namespace = pod["metadata"]["namespace"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return _ref_value(ref, read("Secret", namespace, ref["name"]), "Secret")
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return _ref_value(ref, read("ConfigMap", namespace, ref["name"]), "ConfigMap")
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"])
    raise ValueError(
        f"env {var['name']!r}: valueFrom {sorted(source)} is not supported by the harness"
    )


def decode_secret(data: Mapping[str, str] | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (data or {}).items()}


def read_env_source(core: Any, kind: str, namespace: str, name: str) -> dict[str, str] | None:
    """A Secret's (decoded) or ConfigMap's data, as env references see it; None if absent."""
    from kubernetes.client.exceptions import ApiException

    read = core.read_namespaced_secret if kind == "Secret" else core.read_namespaced_config_map
    try:
        obj = json.loads(read(name, namespace, _preload_content=False).data)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    if kind == "Secret":
        return {**decode_secret(obj.get("data")), **(obj.get("stringData") or {})}
    return dict(obj.get("data") or {})


def process_env(
    container_vars: Mapping[str, str], master_port: int | None, scratch: Path
) -> dict[str, str]:
    """The full environment of the local process: this machine's basics, then the pod's.

    `scratch` stands in for the container's private filesystem: HOME and TMPDIR
    point there, so two pods of one job never share /tmp (the trainer stages
    checkpoints there)."""
    base = {k: os.environ[k] for k in INHERITED if k in os.environ}
    base["HOME"] = base["TMPDIR"] = str(scratch)
    python_bin = str(Path(sys.executable).parent)
    base["PATH"] = f"{python_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    base["PYTHONUNBUFFERED"] = "1"
    base["PYTHONPATH"] = code_path()
    env = {**base, **container_vars}
    if MASTER_ADDR in env:
        env[MASTER_ADDR] = LOCAL_ADDR
    if master_port is not None:
        env[MASTER_PORT] = str(master_port)
    return env


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """command + args (or the image's entrypoint), with `$(VAR)` expanded; `python` is this venv's."""
    command = container.get("command")
    args = container.get("args")
    if command:
        argv = [*command, *(args or [])]
    else:
        entry = image_entrypoint(str(container.get("image", "")))
        argv = [*entry, *args] if args else entry
    argv = [expand(str(part), env) for part in argv]
    if argv and re.fullmatch(r"python[0-9.]*", Path(argv[0]).name):
        argv[0] = sys.executable
    return argv


def describe(argv: list[str]) -> str:
    return shlex.join(argv)


def downward_files(
    pod: Mapping[str, Any], port_of: Callable[[str], int] | None = None,
) -> dict[str, dict[str, str]]:
    """Each downwardAPI volume of the pod: volume name -> {file path: content}, as a kubelet
    writes them (labels and annotations as sorted `key="value"` lines). `port_of(attempt)`
    gives the rendezvous port the harness uses for an attempt (see the module doc)."""
    meta = pod.get("metadata") or {}
    out: dict[str, dict[str, str]] = {}
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        source = volume.get("downwardAPI")
        if source is None:
            continue
        files: dict[str, str] = {}
        for item in source.get("items") or []:
            path = (item.get("fieldRef") or {}).get("fieldPath", "")
            if path in ("metadata.annotations", "metadata.labels"):
                values = dict(meta.get(path.split(".", 1)[1]) or {})
                if path == "metadata.annotations" and MASTER_ADDR_ANNOTATION in values:
                    values[MASTER_ADDR_ANNOTATION] = LOCAL_ADDR
                    attempt = values.get(ATTEMPT_ANNOTATION, "")
                    if port_of is not None and attempt:
                        values[MASTER_PORT_ANNOTATION] = str(port_of(attempt))
                files[item["path"]] = format_control(values)
            elif path:
                files[item["path"]] = field_value(pod, path)
        out[volume["name"]] = files
    return out


def mount_paths(container: Mapping[str, Any]) -> dict[str, str]:
    """volume name -> mount path in the container."""
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts") or []}


def write_files(folder: Path, files: Mapping[str, str]) -> bool:
    """Write a volume's files (each swapped in whole, as a kubelet does); True if any changed."""
    changed = False
    for name, content in files.items():
        target = folder / name
        if target.exists() and target.read_text() == content:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{target.name}.tmp")
        staged.write_text(content)
        staged.replace(target)
        changed = True
    return changed
