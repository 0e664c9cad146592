"""Detached local processes tracked by pid files, so one command starts them
and a later one (another Python process) finds and stops them.

Each process runs in its own session (process group == pid), so stopping it
signals the whole group and leaves no child behind. A pid file records the
process start time as well, so a recycled pid is never mistaken for ours.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def _start_ticks(pid: int) -> str | None:
    """Kernel start time of `pid` (field 22 of /proc/PID/stat), None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces: split after its ')'.
    fields = stat.rsplit(")", 1)[1].split()
    state, ticks = fields[0], fields[19]
    return None if state in ("Z", "X") else ticks


def _reap(pid: int) -> None:
    """Collect the exit status if `pid` is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


@dataclass(frozen=True)
class ManagedProcess:
    """One named long-running process with its pid file and log under `run_dir`."""

    name: str
    run_dir: Path

    @property
    def pid_file(self) -> Path:
        return self.run_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.run_dir / "logs" / f"{self.name}.log"

    def pid(self) -> int | None:
        """The pid of the live process this file names, else None."""
        try:
            pid_text, ticks = self.pid_file.read_text().split()
        except (OSError, ValueError):
            return None
        pid = int(pid_text)
        _reap(pid)
        return pid if _start_ticks(pid) == ticks else None

    def running(self) -> bool:
        return self.pid() is not None

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> int:
        """Start `argv` detached unless it already runs; returns its pid."""
        existing = self.pid()
        if existing is not None:
            return existing
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        ticks = _start_ticks(proc.pid)
        if ticks is None:
            raise RuntimeError(f"{self.name} exited at once; see {self.log_file}")
        self.pid_file.write_text(f"{proc.pid} {ticks}\n")
        return proc.pid

    def stop(self, timeout: float = 15.0) -> bool:
        """Stop the process group (TERM, then KILL after `timeout`); True if one was running."""
        pid = self.pid()
        self.pid_file.unlink(missing_ok=True)
        if pid is None:
            return False
        signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _reap(pid)
            if _start_ticks(pid) is None and not group_alive(pid):
                _reap(pid)  # it may have exited between the first reap and the check
                return True
            time.sleep(0.1)
        signal_group(pid, signal.SIGKILL)
        # SIGKILL cannot be ignored, but a process in uninterruptible I/O on a
        # loaded machine takes a while to die: wait, then reap it if it is ours.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _reap(pid)
            if _start_ticks(pid) is None and not group_alive(pid):
                _reap(pid)
                break
            time.sleep(0.1)
        return True

    def tail(self, lines: int = 20) -> str:
        """The last lines of the log, for error messages."""
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal the process group `pgid` and every process of the session it leads. Our processes
    start in sessions of their own (start_new_session), so the session is what a container's
    cgroup is to a kubelet: an init such as `tini --` moves its child into a group of its own,
    and a kill of the leader's group alone left a deleted pod's supervisor and ranks training
    on (the demo's lost node kept checkpointing and deleted the step the next attempt needed)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for pid in session_members(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (none when `sid` leads no session)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return bool(session_members(pgid))  # the leader's group is gone, its session may not be
    except PermissionError:
        return True
    # A group whose only members are zombies still answers signal 0.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if pgid in (int(fields[2]), int(fields[3])) and fields[0] not in ("Z", "X"):
                return True  # in the group, or in the session it leads (see signal_group)
    return False


# Ports of this process's testbed components that a restart binds again (the API server, the
# S3 server): never handed out while the component is stopped. The long chaos soak, seed 3701,
# session 9: a trainer's rendezvous port picked during an apiserver-restart was the API server's,
# whose start then failed ("bind: address already in use") and left the cluster without one.
_RESERVED: set[int] = set()
# Across processes: a port a testbed's component binds again after a restart is claimed by a file
# named after it in PORTS_DIR, holding the owner's path (a testbed's root, an S3 server's run dir);
# the claim holds while that path exists. CI runs several pytest processes, each with a testbed of
# its own, and the in-process set alone let one process hand a port another process's stopped
# API server was about to bind again (a warm run, 2026-12-07: the ghost-node test's restarted API
# server never answered, and every later test of that process failed).
PORTS_DIR_ENV = "TOPOTRAIN_PORTS_DIR"


def ports_dir() -> Path:
    base = os.environ.get(PORTS_DIR_ENV) or tempfile.gettempdir()
    return Path(base) / f"topotrain-ports-{os.getuid()}"


def _holder(port: int) -> str | None:
    """The owner path of a live claim on `port`, else None (no claim, or its owner is gone)."""
    try:
        owner = (ports_dir() / str(port)).read_text()
    except OSError:
        return None
    return owner if owner and Path(owner).exists() else None


def claim(port: int, owner: Path) -> bool:
    """Claim `port` for `owner` across processes (see PORTS_DIR_ENV); True if it is `owner`'s now,
    False if another live owner holds it. A stale claim (its owner's path gone) is taken over."""
    directory = ports_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path, mine = directory / str(port), str(owner)
    for _ in range(3):
        holder = _holder(port)
        if holder is not None:
            return holder == mine
        path.unlink(missing_ok=True)  # stale, or none
        staged = directory / f".{port}.{os.getpid()}.{random.getrandbits(32):08x}"
        staged.write_text(mine)
        try:
            os.link(staged, path)  # atomic: the claim appears with its owner written, or not at all
            return True
        except FileExistsError:
            continue  # another process claimed it meanwhile: read whose it is
        finally:
            staged.unlink(missing_ok=True)
    return _holder(port) == mine


# (port, owner) claims this process has made while the owner's path existed: not made again on
# every Testbed.settings() (each readiness poll reads the settings).
_CLAIMED: set[tuple[int, str]] = set()


def reserve(*ports: int, owner: Path | None = None) -> None:
    """Keep `ports` out of free_port's picks in this process, and with `owner` in every process
    (claim; a port another live owner holds stays that owner's)."""
    _RESERVED.update(ports)
    if owner is None:
        return
    for port in ports:
        if (port, str(owner)) not in _CLAIMED and claim(port, owner) and owner.exists():
            _CLAIMED.add((port, str(owner)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now and no testbed component owns
    (reserve: this process's, or claimed by any process), taken from below the kernel's
    ephemeral range: a port the kernel hands out (bind to 0) is also what it hands every
    outgoing connection as its source port, so on a busy machine a client could hold it by the
    time the component binds it (etcd once failed to start so: "address already in use")."""
    low, _ = ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - PORT_SPAN), low)
        if port not in _RESERVED and _holder(port) is None and _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: any free one
        sock.bind(("127.0.0.1", 0))
        chosen: int = sock.getsockname()[1]
        return chosen


PORT_SPAN = 12000  # how far below the ephemeral range the testbed picks its ports


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_until(
    check: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.2
) -> None:
    """Poll `check` until it returns True; raise TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def file_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive flock on `directory`/lock (created) for the block: serialises the
    start/stop decisions of concurrent test sessions sharing one state directory."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def sigterm_interrupts() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread, as Ctrl-C does.

    Python's default SIGTERM ends the process at once: no `finally`, no fixture teardown, so a
    test session stopped by a CI timeout or a `kill` left every process it had started (a private
    testbed's API server, etcd, KWOK, the operator) running. As an interrupt, pytest stops the
    session and runs the teardowns, which stop them."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
