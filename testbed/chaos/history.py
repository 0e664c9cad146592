"""The soak's history: every fault and every observation, timestamped, in
memory and as JSON lines on disk. Observations come from the API server
(pods of every namespace, nodes, TrainingJobs), from S3 (a listing of every
job's checkpoint prefix, made directly against versitygw, not through the
chaos proxy), and from /proc (the operator's memory). Nothing is read from
the operator's own memory or logs; the checkers judge only this record and
the stand-in trainers' output.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topotrain.contract import ATTEMPT_ANNOTATION, RESUME_STEP_ANNOTATION
from topotrain.core.manifests import NODE_ANNOTATION, TEMPLATE_ANNOTATION
from topotrain.core.status_lifecycle import RETARGETED

from testbed.chaos import queued
from testbed.harness import ATTEMPT_LABEL, INDEX_LABEL, JOB_LABEL

GROUP, VERSION, PLURAL = "topotrain.io", "v1alpha1", "trainingjobs"


@dataclass
class History:
    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, /, **data: Any) -> dict[str, Any]:
        record = {"t": time.time(), "type": kind, **data}
        with self._lock:
            self.records.append(record)
            with self.path.open("a") as out:
                out.write(json.dumps(record, default=str) + "\n")
        return record

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.records if r["type"] == kind]

    def last(self, kind: str) -> dict[str, Any] | None:
        with self._lock:
            return next((r for r in reversed(self.records) if r["type"] == kind), None)


def pod_record(pod: dict[str, Any]) -> dict[str, Any]:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    containers = spec.get("containers") or [{}]
    gpus = sum(int(((c.get("resources") or {}).get("requests") or {}).get("nvidia.com/gpu", 0))
               for c in containers)  # fmt: skip
    env = {e["name"]: e.get("value") for e in containers[0].get("env") or [] if "name" in e}
    return {
        "ns": meta["namespace"], "name": meta["name"], "uid": meta["uid"],
        "job": labels.get(JOB_LABEL), "attempt": _int(labels.get(ATTEMPT_LABEL)),
        "index": _int(labels.get(INDEX_LABEL)), "phase": status.get("phase"),
        "node": spec.get("nodeName"), "deleting": bool(meta.get("deletionTimestamp")),
        "planned": (meta.get("annotations") or {}).get(NODE_ANNOTATION),  # before it is bound
        "template": (meta.get("annotations") or {}).get(TEMPLATE_ANNOTATION),  # the spec it runs
        "created": meta.get("creationTimestamp"), "gpus": gpus,
        "resume": _resume(meta.get("annotations") or {}, env),
    }  # fmt: skip


def _resume(annotations: dict[str, str], env: dict[str, Any]) -> Any:
    """The step the pod's current attempt resumes from: a pod restarted in place is told by its
    control annotations (the downwardAPI file its supervisor reads), a new pod by its env."""
    if annotations.get(ATTEMPT_ANNOTATION, "") != "":
        return annotations.get(RESUME_STEP_ANNOTATION) or None
    return env.get("TOPOTRAIN_RESUME_STEP")


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def job_record(job: dict[str, Any]) -> dict[str, Any]:
    status = job.get("status") or {}
    return {
        "name": job["metadata"]["name"], "phase": status.get("phase"),
        "reason": status.get("reason"), "message": (status.get("message") or "")[:300],
        "data": (job.get("spec") or {}).get("parallelism", {}).get("data"),
        "conditions": [(c.get("type"), c.get("status"), c.get("reason"))
                       for c in status.get("conditions") or []],
        "deleting": bool(job["metadata"].get("deletionTimestamp")),
        "attempt": status.get("attempt"), "restarts": status.get("restarts"), "lastFailure": (status.get("lastFailure") or {}).get("reason"),
        "lastFailurePod": (status.get("lastFailure") or {}).get("pod"),
        # an in-place attempt moved on to a newer commit before its replacements were created
        "retargeted": str((status.get("recovery") or {}).get("resumeReason") or "").startswith(RETARGETED),
        # the first attempt of the last planned change (a resize, a drain, a rollout; resume.py)
        "planned": (status.get("plannedRestore") or {}).get("attempt"),
    }  # fmt: skip


@dataclass
class Observer:
    """Polls the API server, S3 and /proc every `interval` seconds into the history."""

    history: History
    core: Any
    custom: Any
    namespace: str
    s3_client: Any
    bucket: str
    s3_prefix: str  # "jobs/<namespace>/": every job's checkpoints lie under it
    operator_pids: Callable[[], list[int]]
    interval: float = 1.0
    workloads: bool = False  # Kueue runs: record the namespace's Workloads too (testbed/chaos/queued.py)
    _markers: set[tuple[str, float]] = field(default_factory=set)  # COMMITTED markers read
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Observer:
        self._thread = threading.Thread(target=self._loop, name="chaos-observer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            for probe in (self.observe_api, self.observe_s3, self.observe_memory):
                try:
                    probe()
                except Exception as err:  # the API server or S3 is down: say so, poll again
                    self.history.add("observe-error", probe=probe.__name__, error=str(err)[:200])
            self._stop.wait(max(0.1, self.interval - (time.monotonic() - started)))

    def observe_api(self) -> None:
        raw = self.core.list_pod_for_all_namespaces(_preload_content=False, _request_timeout=10)
        pods = [pod_record(p) for p in json.loads(raw.data)["items"]]
        raw = self.core.list_node(_preload_content=False, _request_timeout=10)
        nodes = {n["metadata"]["name"]: int((n.get("status") or {}).get("allocatable", {})
                                            .get("nvidia.com/gpu", 0))
                 for n in json.loads(raw.data)["items"]}  # fmt: skip
        raw = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, _preload_content=False, _request_timeout=10
        )
        jobs = [job_record(j) for j in json.loads(raw.data)["items"]]
        extra: dict[str, Any] = {}
        if self.workloads:
            raw = self.custom.list_namespaced_custom_object(
                queued.GROUP, queued.VERSION, self.namespace, queued.WORKLOADS, _preload_content=False,
                _request_timeout=10)  # fmt: skip
            extra["workloads"] = [queued.workload_record(w) for w in json.loads(raw.data)["items"]]
        self.history.add("api", pods=pods, nodes=nodes, jobs=jobs, **extra)

    def observe_s3(self) -> None:
        keys: dict[str, float] = {}
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.s3_prefix}
            if token:
                args["ContinuationToken"] = token
            page = self.s3_client.list_objects_v2(**args)
            for obj in page.get("Contents", []):
                keys[str(obj["Key"])[len(self.s3_prefix):]] = obj["LastModified"].timestamp()
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        committed: dict[str, dict[int, float]] = {}
        saved: dict[str, list[tuple[int, float, Any]]] = {}  # markers not read before: by whom
        for key, modified in keys.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == "COMMITTED" and parts[1].startswith("step-"):
                committed.setdefault(parts[0], {})[int(parts[1][5:])] = modified
                if (key, modified) not in self._markers and (saver := self._saver(key)) is not None:
                    saved.setdefault(parts[0], []).append((int(parts[1][5:]), modified, saver[0]))
                    self._markers.add((key, modified))
        self.history.add("s3", committed={j: sorted(s.items()) for j, s in committed.items()},
                         saved=saved)  # fmt: skip

    def _saver(self, key: str) -> tuple[int | None] | None:
        """(the attempt a COMMITTED marker says saved its step, None if it does not say), or
        None when it could not be read (deleted by retention meanwhile: read again next time)."""
        try:
            body = self.s3_client.get_object(Bucket=self.bucket, Key=self.s3_prefix + key)["Body"].read()
        except Exception:
            return None
        attempt = json.loads(body).get("attempt")
        return (int(attempt) if attempt is not None else None,)

    def observe_memory(self) -> None:
        rss = {}
        for pid in self.operator_pids():
            try:
                text = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            line = next((x for x in text.splitlines() if x.startswith("VmRSS:")), "")
            if line:
                rss[str(pid)] = int(line.split()[1]) / 1024
        if rss:
            self.history.add("rss", mib=rss)
