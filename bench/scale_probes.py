"""What bench/scale.py measures the operator with, each from outside the operator:

- `RequestCounter`: a plain-HTTP proxy on 127.0.0.1 in front of the API server
  (TLS, the admin client certificate) that the operator's kubeconfig points at;
  it counts every request line by verb and resource. The API server's own
  `apiserver_request_total` has no user or user-agent label, so it cannot tell
  the operator's requests from the scheduler's, KWOK's or the controllers'.
- `JobRecorder`: a watch on the namespace's TrainingJobs that records, on this
  machine's clock, when each job's `status.phase` was first seen Running.
- `scrape_histogram` / `histogram_quantile`: the operator's Prometheus
  endpoint, quantiles interpolated within buckets as Prometheus does.
- `proc_usage`: CPU seconds and peak RSS of a process from /proc.
- `HealthProbe`: the operator's /healthz polled every second through the run,
  each answer's latency and the misses against the chart's liveness timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

GROUP, VERSION, PLURAL = "topotrain.io", "v1alpha1", "trainingjobs"


# --- API requests --------------------------------------------------------------


def classify(method: str, target: str) -> tuple[str, str]:
    """(verb, resource[/subresource]) of one request, in the API server's own terms."""
    parts = urlsplit(target)
    segs = [s for s in parts.path.split("/") if s]
    if segs[:1] == ["api"] and len(segs) >= 2:
        rest = segs[2:]
    elif segs[:1] == ["apis"] and len(segs) >= 3:
        rest = segs[3:]
    else:
        return method.lower(), "discovery"
    if not rest:
        return method.lower(), "discovery"
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource += "/" + rest[2]
    query = parse_qs(parts.query)
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch"}
    if method == "GET":
        verb = "watch" if query.get("watch", [""])[0] in ("true", "1") else "get" if name else "list"
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = verbs.get(method, method.lower())
    return verb, resource


class _RequestParser:
    """Finds request lines in one connection's client-to-server bytes (bodies skipped)."""

    def __init__(self, count: Any) -> None:
        self.buffer = b""
        self.body_left = 0
        self.lost = False  # a chunked request body: stop parsing this connection
        self.count = count

    def feed(self, data: bytes) -> None:
        if self.lost:
            return
        self.buffer += data
        while True:
            if self.body_left:
                taken = min(self.body_left, len(self.buffer))
                self.buffer, self.body_left = self.buffer[taken:], self.body_left - taken
                if self.body_left:
                    return
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buffer = self.buffer[:end].decode("latin-1"), self.buffer[end + 4:]
            lines = head.split("\r\n")
            method, _, rest = lines[0].partition(" ")
            target = rest.partition(" ")[0]
            self.count(method, target)
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self.lost = True
                return
            self.body_left = int(headers.get("content-length") or 0)


class RequestCounter:
    """A counting proxy: plain HTTP on 127.0.0.1:`port` to the API server over TLS."""

    def __init__(self, upstream: tuple[str, int], pki: Path) -> None:
        self.upstream = upstream
        self.tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.tls.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="request-counter", daemon=True)
        self.port = 0
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the counting proxy did not start")

    def snapshot(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self.counts)

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig that sends a client through this proxy (no credentials: the proxy has them)."""
        server = f"http://127.0.0.1:{self.port}"
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: bench\n"
            f"clusters: [{{name: bench, cluster: {{server: '{server}'}}}}]\n"
            "users: [{name: bench, user: {}}]\n"
            "contexts: [{name: bench, context: {cluster: bench, user: bench}}]\n"
        )
        return path

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _count(self, method: str, target: str) -> None:
        key = classify(method, target)
        with self._lock:
            self.counts[key] += 1

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream, ssl=self.tls)
        except OSError:
            writer.close()
            return
        parser = _RequestParser(self._count)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, parse: bool) -> None:
            try:
                while data := await src.read(65536):
                    if parse:
                        parser.feed(data)
                    dst.write(data)
                    await dst.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                with contextlib.suppress(OSError, RuntimeError, ssl.SSLError):
                    dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))


# --- TrainingJobs --------------------------------------------------------------


@dataclass
class JobRecord:
    name: str
    applied: float = 0.0  # time.time() just before the create call
    running: float | None = None  # first observation of phase Running
    phase: str = ""
    conditions: list[dict[str, Any]] = field(default_factory=list)
    data: int | None = None  # status.parallelism.data


class JobRecorder:
    """Watches the namespace's TrainingJobs; first time each was seen Running."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.jobs: dict[str, JobRecord] = {}
        self.last_change = time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-recorder", daemon=True)
        self._thread.start()

    def applied(self, name: str, when: float) -> None:
        with self._lock:
            self.jobs.setdefault(name, JobRecord(name)).applied = when

    def records(self) -> list[JobRecord]:
        with self._lock:
            return [JobRecord(**vars(r)) for r in self.jobs.values()]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)

    def _note(self, obj: dict[str, Any], seen: float) -> None:
        name = obj["metadata"]["name"]
        status = obj.get("status") or {}
        with self._lock:
            record = self.jobs.setdefault(name, JobRecord(name))
            phase = status.get("phase") or ""
            if phase != record.phase or status.get("conditions", []) != record.conditions:
                self.last_change = seen
            record.phase, record.conditions = phase, list(status.get("conditions") or [])
            record.data = (status.get("parallelism") or {}).get("data")
            if phase == "Running" and record.running is None:
                record.running = seen

    def _run(self) -> None:
        version = ""
        while not self._stop.is_set():
            try:
                if not version:
                    listed = cast(dict[str, Any], self.custom.list_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, PLURAL))
                    for obj in listed["items"]:
                        self._note(obj, time.time())
                    version = listed["metadata"]["resourceVersion"]
                stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                    self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                    resource_version=version, timeout_seconds=5, allow_watch_bookmarks=True,
                )
                for event in stream:
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        version = ""  # 410 Gone: list again
                        break
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._note(obj, time.time())
            except (ApiException, HTTPError, OSError, ValueError):
                version = ""
                self._stop.wait(0.5)


# --- operator metrics and process ----------------------------------------------


def scrape_histogram(port: int, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets (le, count), count, sum) of an unlabelled histogram."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    buckets: list[tuple[float, float]] = []
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith(f"{name}_count"):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum"):
            total = float(line.rsplit(" ", 1)[1])
    return sorted(buckets), count, total


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile, linear within the bucket; but a rank in the +Inf bucket
    gives inf (Prometheus gives the last finite bound, which reads as a measurement)."""
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def scrape_counter(port: int, name: str) -> float:
    """The sum of a counter's samples over all its labels."""
    return sum(scrape_counter_by(port, name).values())


def scrape_counter_by(port: int, name: str) -> dict[str, float]:
    """A counter's samples by their label set as written (`resource="nodes"`; "" unlabelled)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((f"{name}{{", f"{name} ")):
            head, value = line.rsplit(" ", 1)
            labels = head[len(name):].strip().strip("{}")
            samples[labels] = samples.get(labels, 0.0) + float(value)
    return samples


@dataclass(frozen=True)
class ProbeSettings:
    """The chart's livenessProbe (charts/topotrain/values.yaml)."""

    period_s: float
    timeout_s: float
    failure_threshold: int

    @classmethod
    def from_chart(cls, values: Path) -> ProbeSettings:
        probe = (yaml.safe_load(values.read_text()) or {}).get("livenessProbe") or {}
        return cls(float(probe.get("periodSeconds", 10)), float(probe.get("timeoutSeconds", 1)),
                   int(probe.get("failureThreshold", 3)))


class HealthProbe:
    """Polls the operator's /healthz every `every` seconds, as the kubelet's liveness probe
    would but more often: each answer's latency, and the misses (an error, or no answer within
    the chart's timeoutSeconds). Started with the process: until the endpoint first answers
    (`up_after`), a refusal is not a miss."""

    def __init__(self, port: int, probe: ProbeSettings, every: float = 1.0) -> None:
        self.port, self.probe, self.every = port, probe, every
        self.latencies: list[float] = []
        self.misses: list[float] = []  # time.time() of each miss
        self.why: Counter[str] = Counter()  # what each miss was
        # the event loop's heartbeat age in each answer (topotrain.controller.health): how long the loop
        # went without running, which the answer's own latency no longer shows
        self.loop_ages: list[float] = []
        self.began, self.up_after = time.monotonic(), float("nan")  # seconds to the first answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.probe.timeout_s + 5)

    def longest_miss_streak(self) -> float:
        """Seconds of the longest run of consecutive misses (0 when none)."""
        longest, start, last = 0.0, None, None
        for when in self.misses:
            if start is None or last is None or when - last > self.every * 1.5 + self.probe.timeout_s:
                start = when
            last = when
            longest = max(longest, when - start + self.every)
        return longest

    def _run(self) -> None:
        url = f"http://127.0.0.1:{self.port}/healthz"
        while not self._stop.is_set():
            began = time.monotonic()
            why = ""
            try:
                with urllib.request.urlopen(url, timeout=self.probe.timeout_s) as response:
                    body = response.read()
                with contextlib.suppress(ValueError, AttributeError):
                    self.loop_ages.append(float(json.loads(body)["loopHeartbeatAgeSeconds"]))
            except OSError as exc:  # refused, reset, timed out, or an HTTP error status
                why = type(exc).__name__ + (f" {exc.code}" if isinstance(exc, urllib.error.HTTPError) else "")
            took = time.monotonic() - began
            self.latencies.append(took)
            if not why and took >= self.probe.timeout_s:
                why = "slow"
            if not why and self.up_after != self.up_after:
                self.up_after = time.monotonic() - self.began
            if why and self.up_after != self.up_after:
                self.latencies.pop()  # not serving yet
            elif why:
                self.misses.append(time.time())
                self.why[why] += 1
            self._stop.wait(max(0.0, self.every - took))


def metrics_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2):
            return True
    except OSError:
        return False


def proc_usage(pid: int) -> tuple[float, float]:
    """(user+system CPU seconds, peak RSS MiB) of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    peak = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) / 1024
    return cpu, peak


WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY")


def server_writes(api: client.ApiClient) -> Counter[tuple[str, str]]:
    """Every client's writes the API server has served so far, by (verb, resource), from its own
    `apiserver_request_total` (what the operator, KWOK, the controller manager and the scheduler
    asked of it together: where the API server's time goes beside the operator's requests)."""
    response = api.call_api("GET", f"{api.configuration.host}/metrics")
    response.read()
    counts: Counter[tuple[str, str]] = Counter()
    for line in response.data.decode().splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_text, _, value = line[len("apiserver_request_total{"):].rpartition("} ")
        labels = dict(part.split("=", 1) for part in labels_text.split('",') if "=" in part)
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("verb") in WRITE_VERBS:
            resource = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
            counts[(labels["verb"], resource)] += int(float(value))
    return counts
