"""Helpers of the pod process harness (`testbed.harness`): process groups
under /proc, the pod status a kubelet writes for a terminated container, and
reading the JSON lines of pod logs. Not a kubelet; see testbed.harness."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from testbed.procs import signal_group

HEADER_PREFIX = "# harness"


@dataclass(frozen=True)
class PodLaunch:
    """When the harness started a pod's process (wall clock), for timing recoveries."""

    namespace: str
    name: str
    job: str
    attempt: str
    node: str
    time: float


@dataclass
class PodRun:
    """One pod's container, run as a local process group."""

    uid: str
    namespace: str
    name: str
    node: str
    job: str
    attempt: str
    container: str
    image: str
    process: subprocess.Popen[bytes]
    log_path: Path
    pid_file: Path
    started_at: str
    frozen: bool = False
    kill_deadline: float | None = None  # set once termination began
    lost: bool = False  # killed with its node
    downward: dict[str, Path] = field(default_factory=dict)  # downwardAPI volume -> its folder

    @property
    def pgid(self) -> int:
        return self.process.pid


@dataclass(frozen=True)
class PodExit:
    """What the harness reported (or would have) for a finished pod."""

    namespace: str
    name: str
    job: str
    attempt: str
    exit_code: int
    reason: str
    log_path: Path


def now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def start_ticks(pid: int) -> str | None:
    """Kernel start time of `pid`, None when it is gone or a zombie (guards against pid reuse)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def tail(path: Path, limit: int = 2048) -> str:
    """The end of a log, as a kubelet's FallbackToLogsOnError termination message."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - limit))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(
        line for line in text.splitlines() if not line.startswith(HEADER_PREFIX)
    ).strip()


def terminated_status(
    container: dict[str, Any], exit_code: int, reason: str, message: str, started_at: str
) -> dict[str, Any]:
    """The status patch a kubelet sends when a restartPolicy=Never pod's only container ends."""
    finished = now()
    terminated: dict[str, Any] = {
        "exitCode": exit_code,
        "reason": reason,
        "startedAt": started_at,
        "finishedAt": finished,
    }
    if message:
        terminated["message"] = message
    not_ready = {
        "status": "False",
        "lastTransitionTime": finished,
        "reason": "PodCompleted" if exit_code == 0 else "PodFailed",
    }
    return {
        "status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": [
                {"type": "Ready", **not_ready},
                {"type": "ContainersReady", **not_ready},
            ],
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {"terminated": terminated},
                }
            ],
        }
    }


def json_lines(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """The JSON objects among the lines of the given logs (the trainer logs metrics as JSON lines)."""
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict):
                        yield record


def events_by_attempt(paths: Iterable[Path]) -> dict[int, list[dict[str, Any]]]:
    """The JSON events of pod logs named `a<attempt>-...log`, per attempt.

    A pod kept across an in-place restart logs several attempts in its one file: its
    supervisor's `workers_started` event names the attempt the lines after it belong to."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in paths:
        attempt = int(path.name[1:].split("-", 1)[0])
        for record in json_lines([path]):
            if "event" not in record:
                continue
            if record["event"] == "workers_started" and "attempt" in record:
                attempt = int(record["attempt"])
            out.setdefault(attempt, []).append(record)
    return out


def spawn(
    argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, *, node: str
) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session (its own process group), output appended to `log_path`."""
    with log_path.open("ab") as out:
        out.write(f"{HEADER_PREFIX} (not a kubelet): node {node}: {shlex.join(argv)}\n".encode())
        out.flush()
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def record_pid(pid_file: Path, pid: int) -> None:
    """Remember a process group so a later harness can kill it if this one dies uncleanly."""
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{pid} {start_ticks(pid)}\n")


def kill_recorded(pid_dir: Path) -> list[int]:
    """SIGKILL every recorded process group still alive (same start time); returns their ids."""
    killed = []
    for pid_file in pid_dir.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid, ticks = pid_file.read_text().split()
            if start_ticks(int(pid)) == ticks:
                signal_group(int(pid), signal.SIGKILL)
                killed.append(int(pid))
        pid_file.unlink(missing_ok=True)
    return killed
