"""The pod process harness: runs the containers of TrainingJob pods that sit
on KWOK nodes as local processes, because KWOK marks them Running but runs
nothing.

It stands in for a kubelet's *process execution* only; it is not a kubelet.
There are no images, no isolation, no volumes but downwardAPI ones (written
as files, see below), no probes and no container restarts; every "node" is this machine. What it does, per pass (every
`interval` seconds, level-triggered from the API server's state):

- A pod labelled `topotrain.io/job`, bound to a live KWOK node and Running:
  its container's command (or the trainer image's entrypoint) starts as a
  local process, in a process group of its own, with the pod's environment
  resolved as a kubelet would (`valueFrom` Secrets, ConfigMaps, fieldRefs).
  `MASTER_ADDR` becomes 127.0.0.1 and `MASTER_PORT` a port per job attempt:
  see `testbed.harness_env`.
- The process exits: the pod's status subresource is patched to Succeeded or
  Failed with `containerStatuses[].state.terminated` (exit code, reason), as
  the kubelet reports it. KWOK's pod stages leave such a pod alone (they
  only move Pending pods to Running, and Running pods owned by a Job).
- The pod is deleted: its process group gets SIGTERM, then SIGKILL after the
  grace period.
- Its node fails (deleted, made NotReady by fault injection, or no longer
  run by KWOK): the group is killed at once, as the machine's death would;
  nothing is reported, since a dead node's kubelet reports nothing. A node
  that is merely late with heartbeats keeps its processes. If the node comes back, the
  pod is reported Failed with exit code 137 and reason
  ContainerStatusUnknown, as a kubelet does for a container it lost.
- `freeze`/`thaw` SIGSTOP/SIGCONT a pod's processes: a hang with the pod up.
- downwardAPI volumes (labels, annotations, fieldRefs) are files under the
  pod's scratch directory, rewritten on the pass that sees the pod's
  metadata change, as a kubelet does; the control volume's folder reaches the
  process as `TOPOTRAIN_CONTROL_DIR` (see `testbed.harness_env`).

Logs go to `<workdir>/logs/<namespace>/<job>/`, one file per pod run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from topotrain.contract import CONTROL_DIR, CONTROL_DIR_ENV

from testbed.client import api_client, core_v1
from testbed.components import KWOK_NODE_ANNOTATION, KWOK_NODE_VALUE
from testbed.faults import NODE_NOT_READY_STAGE
from testbed.harness_env import (
    container_argv,
    container_env,
    downward_files,
    mount_paths,
    process_env,
    read_env_source,
    write_files,
)
from testbed.harness_proc import (
    PodExit,
    PodLaunch,
    PodRun,
    json_lines,
    kill_recorded,
    now,
    record_pid,
    spawn,
    tail,
    terminated_status,
)
from testbed.procs import free_port, group_alive, signal_group

JOB_LABEL = "topotrain.io/job"
ATTEMPT_LABEL = "topotrain.io/attempt"
INDEX_LABEL = "topotrain.io/index"
LOST_EXIT_CODE = 137
__all__ = ["PodExit", "PodLaunch", "PodProcessHarness", "PodRun", "json_lines"]
MAX_GRACE_SECONDS = 10.0
STRATEGIC = "application/strategic-merge-patch+json"
HOLD_FINALIZER = "testbed.topotrain.io/processes"  # see PodProcessHarness.hold_terminating
HOLD_ENV = "TOPOTRAIN_HARNESS_HOLD_TERMINATING"  # "1": hold_terminating by default

log = logging.getLogger("topotrain.testbed.harness")


@dataclass
class _Snapshot:
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> pod
    live_nodes: set[str] = field(default_factory=set)


class PodProcessHarness:
    """Runs TrainingJob pods bound to KWOK nodes as local processes (see the module doc)."""

    def __init__(
        self,
        kubeconfig: Path | str,
        workdir: Path | str,
        *,
        namespace: str | None = None,
        label_selector: str = JOB_LABEL,
        interval: float = 0.5,
        hold_terminating: bool | None = None,
    ) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.workdir = Path(workdir).resolve()
        self.namespace = namespace
        self.label_selector = label_selector
        self.interval = interval
        # Keep a deleted pod's object (Terminating) until its processes have exited, as a kubelet
        # does: KWOK deletes a pod the moment it has a deletionTimestamp, so without this the
        # operator sees an evicted pod gone while its trainer still saves its SIGTERM checkpoint.
        # A finalizer of ours on each pod that runs, removed when its processes are gone.
        if hold_terminating is None:
            hold_terminating = os.environ.get(HOLD_ENV, "") == "1"
        self.hold_terminating = hold_terminating
        self.exits: list[PodExit] = []
        self.launches: list[PodLaunch] = []
        self._runs: dict[str, PodRun] = {}
        self._lost: dict[str, PodRun] = {}  # uid -> run killed with its node, not yet reported
        self._done: set[str] = set()  # uids never to start again
        self._ports: dict[tuple[str, str, str], int] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._api: Any = None

    # --- lifecycle -------------------------------------------------------

    def start(self) -> PodProcessHarness:
        """Kill what an earlier harness in this workdir left behind, then run passes in a thread."""
        self._kill_leftovers()
        self._api = api_client(self.kubeconfig)
        log.info(
            "pod process harness (stands in for kubelet process execution) watching %s",
            self.label_selector,
        )
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="pod-process-harness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop passing and kill every process this harness started."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            for run in list(self._runs.values()):
                self._kill(run, signal.SIGKILL)
                self._forget(run)
        if self._api is not None:
            self._api.close()
            self._api = None

    def __enter__(self) -> PodProcessHarness:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception:  # keep serving: a failed pass is retried on the next one
                log.exception("harness pass failed")
            self._stop.wait(self.interval)

    # --- queries and fault controls for tests and the demo ---------------

    def running(self, namespace: str | None = None, job: str | None = None) -> list[PodRun]:
        with self._lock:
            return [
                r
                for r in self._runs.values()
                if r.kill_deadline is None
                and (namespace is None or r.namespace == namespace)
                and (job is None or r.job == job)
            ]

    def job_logs(self, namespace: str, job: str) -> list[Path]:
        """Every log file of the job's pods, by attempt, then oldest run first."""
        folder = self.workdir / "logs" / namespace / job

        def order(path: Path) -> tuple[int, int, str]:
            attempt = path.name[1:].split("-", 1)[0]
            return (int(attempt) if attempt.isdigit() else 0, path.stat().st_mtime_ns, path.name)

        return sorted(folder.glob("*.log"), key=order)

    def freeze(self, namespace: str, job: str) -> int:
        """SIGSTOP the processes of the job's pods (a hang: pods stay Running); returns how many."""
        return self._signal_job(namespace, job, signal.SIGSTOP, frozen=True)

    def thaw(self, namespace: str, job: str) -> int:
        return self._signal_job(namespace, job, signal.SIGCONT, frozen=False)

    def _signal_job(self, namespace: str, job: str, sig: signal.Signals, *, frozen: bool) -> int:
        runs = self.running(namespace, job)
        for run in runs:
            log.warning(
                "harness: %s to pod %s/%s (process group %d)",
                sig.name,
                namespace,
                run.name,
                run.pgid,
            )
            signal_group(run.pgid, sig)
            run.frozen = frozen
        return len(runs)

    # --- one pass ----------------------------------------------------------

    def sync_once(self) -> None:
        """Compare the API server's pods and nodes with the local processes and act."""
        snapshot = self._snapshot()
        with self._lock:
            for uid, run in list(self._runs.items()):
                self._check_run(run, snapshot.pods.get(uid), snapshot.live_nodes)
            for uid, run in list(self._lost.items()):
                self._report_lost(run, snapshot.pods.get(uid), snapshot.live_nodes)
            for uid, pod in snapshot.pods.items():
                if (
                    uid not in self._runs
                    and uid not in self._done
                    and self._startable(pod, snapshot)
                ):
                    self._launch(pod)

    def _snapshot(self) -> _Snapshot:
        core = core_v1(self._api)
        if self.namespace:
            resp = core.list_namespaced_pod(
                self.namespace, label_selector=self.label_selector, _preload_content=False
            )
        else:
            resp = core.list_pod_for_all_namespaces(
                label_selector=self.label_selector, _preload_content=False
            )
        pods = {p["metadata"]["uid"]: p for p in json.loads(resp.data)["items"]}
        nodes = json.loads(core.list_node(_preload_content=False).data)["items"]
        return _Snapshot(pods, {n["metadata"]["name"] for n in nodes if _node_alive(n)})

    def _startable(self, pod: dict[str, Any], snapshot: _Snapshot) -> bool:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        return (
            meta.get("deletionTimestamp") is None
            and status.get("phase") == "Running"
            and spec.get("nodeName") in snapshot.live_nodes
        )

    def _check_run(self, run: PodRun, pod: dict[str, Any] | None, live_nodes: set[str]) -> None:
        code = run.process.poll()
        if run.kill_deadline is not None:
            if code is not None and not group_alive(run.pgid):
                if self.hold_terminating and pod is not None and not run.lost:
                    self._report_exit(run, pod, code)  # as a kubelet reports a stopped container
                self._forget(run)
            elif time.monotonic() > run.kill_deadline:
                self._kill(run, signal.SIGKILL)
            return
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            grace = float((pod or {}).get("spec", {}).get("terminationGracePeriodSeconds") or 30)
            log.info(
                "harness: pod %s/%s deleted: SIGTERM to its processes", run.namespace, run.name
            )
            # (held pods get their whole grace period, as a kubelet gives it; the others are capped
            # to keep tests short)
            self._terminate(run, grace if self.hold_terminating else min(grace, MAX_GRACE_SECONDS))
            return
        if run.node not in live_nodes:
            log.warning(
                "harness: node %s failed: killing pod %s/%s's processes",
                run.node,
                run.namespace,
                run.name,
            )
            self._kill(run, signal.SIGKILL)
            run.lost = True
            self._lost[run.uid] = run
            self._terminate(run, 0)
            return
        if code is not None:
            self._kill(run, signal.SIGKILL)  # a container's exit ends what it spawned
            self._report_exit(run, pod, code)
            self._forget(run)
            return
        self._write_downward(run, pod)

    def _write_downward(self, run: PodRun, pod: dict[str, Any]) -> None:
        """Rewrite the pod's downwardAPI files when its metadata changed (a kubelet's sync)."""
        files = downward_files(pod, lambda attempt: self._port(run.namespace, run.job, attempt))
        for volume, folder in run.downward.items():
            if write_files(folder, files.get(volume, {})):
                log.info("harness: pod %s/%s: downwardAPI volume %s updated", run.namespace,
                         run.name, volume)

    # --- processes ---------------------------------------------------------

    def _launch(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid, namespace, name = meta["uid"], meta["namespace"], meta["name"]
        labels = meta.get("labels") or {}
        job, attempt = labels.get(JOB_LABEL, ""), labels.get(ATTEMPT_LABEL, "0")
        container = spec["containers"][0]
        if len(spec["containers"]) > 1:
            log.warning(
                "harness: pod %s/%s: only container %r runs", namespace, name, container["name"]
            )
        log_path = self.workdir / "logs" / namespace / job / f"a{attempt}-{name}-{uid[:8]}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            variables = container_env(pod, container, self._read_object)
            scratch = self.workdir / "pods" / uid
            scratch.mkdir(parents=True, exist_ok=True)
            env = process_env(
                variables,
                self._port(namespace, job, attempt) if "MASTER_PORT" in variables else None,
                scratch,
            )
            downward = self._volumes(pod, container, scratch, env)
            argv = container_argv(container, env)
        except (LookupError, ValueError) as err:
            # A kubelet reports CreateContainerConfigError and keeps waiting; we fail the pod.
            self._done.add(uid)
            log.error("harness: pod %s/%s cannot start: %s", namespace, name, err)
            log_path.write_text(f"harness: cannot start: {err}\n")
            self._patch_terminated(
                namespace, name, container, 128, "CreateContainerConfigError", str(err), now()
            )
            return
        # Only now is the pod done with: an API error reading its Secrets or ConfigMaps (the API
        # server restarting) propagates and the next pass starts it, as a kubelet retries. Marked
        # done before that, such a pod stayed Running with no process (its gang hung at rendezvous
        # through two restarts in a bounded soak).
        self._done.add(uid)
        process = spawn(argv, env, scratch, log_path, node=spec["nodeName"])
        pid_file = self.workdir / "pids" / f"{uid}.pid"
        record_pid(pid_file, process.pid)
        self._runs[uid] = PodRun(
            uid,
            namespace,
            name,
            spec["nodeName"],
            job,
            attempt,
            container["name"],
            container.get("image", ""),
            process,
            log_path,
            pid_file,
            now(),
            downward=downward,
        )
        if self.hold_terminating:
            self._finalizer(namespace, name, {"finalizers": [HOLD_FINALIZER]})
        self.launches.append(PodLaunch(namespace, name, job, attempt, spec["nodeName"], time.time()))
        log.info(
            "harness: started pod %s/%s on %s as pid %d",
            namespace,
            name,
            spec["nodeName"],
            process.pid,
        )

    def _volumes(
        self, pod: dict[str, Any], container: dict[str, Any], scratch: Path, env: dict[str, str],
    ) -> dict[str, Path]:
        """Write the pod's downwardAPI volumes into its scratch folder; point the process at the
        control volume (it cannot be mounted at its path on this machine)."""
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        files = downward_files(
            pod, lambda attempt: self._port(meta["namespace"], labels.get(JOB_LABEL, ""), attempt)
        )
        mounts = mount_paths(container)
        folders: dict[str, Path] = {}
        for volume, content in files.items():
            if volume not in mounts:
                continue
            folder = scratch / "volumes" / volume
            folder.mkdir(parents=True, exist_ok=True)
            write_files(folder, content)
            folders[volume] = folder
            if mounts[volume] == CONTROL_DIR:
                env[CONTROL_DIR_ENV] = str(folder)
        return folders

    def _port(self, namespace: str, job: str, attempt: str) -> int:
        key = (namespace, job, attempt)
        if key not in self._ports:
            self._ports[key] = free_port()
        return self._ports[key]

    def _read_object(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        return read_env_source(core_v1(self._api), kind, namespace, name)

    def _terminate(self, run: PodRun, grace: float) -> None:
        self._kill(run, signal.SIGTERM)
        if run.frozen:
            self._kill(run, signal.SIGCONT)
        run.kill_deadline = time.monotonic() + grace

    def _kill(self, run: PodRun, sig: signal.Signals) -> None:
        signal_group(run.pgid, sig)

    def _forget(self, run: PodRun) -> None:
        run.process.poll()
        self._runs.pop(run.uid, None)
        run.pid_file.unlink(missing_ok=True)
        if self.hold_terminating:  # its processes are gone: the pod object may go too
            self._finalizer(run.namespace, run.name, {"$deleteFromPrimitiveList/finalizers": [HOLD_FINALIZER]})

    def _finalizer(self, namespace: str, name: str, meta_patch: dict[str, Any]) -> None:
        try:
            core_v1(self._api).patch_namespaced_pod(
                name, namespace, {"metadata": meta_patch}, _content_type=STRATEGIC, _preload_content=False
            )
        except ApiException as err:
            if err.status != 404:  # a pod already gone needs nothing
                log.warning("harness: pod %s/%s: finalizer patch failed: %s", namespace, name, err)

    def _kill_leftovers(self) -> None:
        for pgid in kill_recorded(self.workdir / "pids"):
            log.warning("harness: killed leftover process group %d of an earlier harness", pgid)

    # --- status reports ----------------------------------------------------

    def _report_exit(self, run: PodRun, pod: dict[str, Any], code: int) -> None:
        exit_code = code if code >= 0 else 128 - code  # killed by a signal: 128 + signal number
        reason = "Completed" if exit_code == 0 else "Error"
        container = next(
            (c for c in pod["spec"]["containers"] if c["name"] == run.container),
            {"name": run.container},
        )
        message = tail(run.log_path) if exit_code else ""
        self._patch_terminated(
            run.namespace, run.name, container, exit_code, reason, message, run.started_at
        )
        self._record(run, exit_code, reason)

    def _report_lost(self, run: PodRun, pod: dict[str, Any] | None, live_nodes: set[str]) -> None:
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            self._lost.pop(run.uid)
            return
        if run.node in live_nodes and (pod.get("status") or {}).get("phase") == "Running":
            container = {"name": run.container, "image": run.image}
            message = "The container could not be located when the pod was terminated"
            self._patch_terminated(
                run.namespace,
                run.name,
                container,
                LOST_EXIT_CODE,
                "ContainerStatusUnknown",
                message,
                run.started_at,
            )
            self._record(run, LOST_EXIT_CODE, "ContainerStatusUnknown")
            self._lost.pop(run.uid)

    def _record(self, run: PodRun, exit_code: int, reason: str) -> None:
        self.exits.append(
            PodExit(run.namespace, run.name, run.job, run.attempt, exit_code, reason, run.log_path)
        )
        log.info("harness: pod %s/%s exited %d (%s)", run.namespace, run.name, exit_code, reason)

    def _patch_terminated(
        self,
        namespace: str,
        name: str,
        container: dict[str, Any],
        exit_code: int,
        reason: str,
        message: str,
        started_at: str,
    ) -> None:
        body = terminated_status(container, exit_code, reason, message, started_at)
        try:
            core_v1(self._api).patch_namespaced_pod_status(
                name, namespace, body, _content_type=STRATEGIC, _preload_content=False
            )
        except ApiException as err:
            if err.status != 404:  # a pod deleted meanwhile needs no report
                raise


def _node_alive(node: dict[str, Any]) -> bool:
    """The machine behind the node still runs: the node exists, KWOK still acts as its kubelet,
    and no NotReady fault was injected. A Ready condition gone stale because the control plane
    is slow to see heartbeats is not a dead machine: its processes keep running."""
    meta = node["metadata"]
    if (meta.get("annotations") or {}).get(KWOK_NODE_ANNOTATION) != KWOK_NODE_VALUE:
        return False
    return (meta.get("labels") or {}).get(NODE_NOT_READY_STAGE) != "true"
