"""Forked ranks: the pod's local ranks forked from one interpreter that has imported the trainer.

A rank started as a fresh interpreter imports torch and the trainer first: several CPU-seconds
and several hundred MB per rank (the bundled trainer: about 7 CPU-s and 0.8 GB), paid again by
every rank of every in-place restart. With forked ranks the supervisor starts one *forker* per
pod, which imports once and then forks a child per rank on request; the children share the
imported pages copy-on-write, and a restart's ranks start in milliseconds.

Both ends are here, stdlib only:

- the worker program (a Python trainer) calls `serve()` when `FORK_ENV` is set in its
  environment, after importing what its ranks need. `serve()` returns in each forked child with
  that rank's environment (already in `os.environ`): the program goes on as the rank, and its
  ordinary exit (atexit, non-daemon threads) is the rank's. In the forker it returns None when the
  supervisor lets it go.
- any Python trainer gets it without a line of its own: `topotrain-launch --fork -- python
  train.py ...` (or `-m module`) runs `python -m topotrain_sdk.forker [--preload torch] train.py
  ...` as the forker, which imports the preload modules (torch by default), serves, and runs
  the script (or module) as `__main__` in each child, as `python train.py ...` would.
- the supervisor (`Forker`) starts the forker as `worker_argv` with `FORK_ENV`, writes one JSON
  line per rank (its environment) on the forker's stdin and reads the forker's replies (the
  child's pid, later its exit status) from a pipe of their own; a `ForkedRank` stands for the
  child as a `subprocess.Popen` would (poll, wait, send_signal, kill, pid).

Forking is refused (and the supervisor starts that rank as a fresh interpreter) when the forker
runs more than one thread: a fork copies only the calling thread, and a lock another thread held
would stay held in the child. Importing torch with one OpenMP thread (the forker's environment)
starts no thread and initialises no CUDA device, so each child initialises its own device as a
fresh process would, and sets the intra-op threads its own OMP_NUM_THREADS (or torch's default)
asks for. The forker ignores SIGTERM and
SIGINT (a pod stop signals the whole process group: the ranks must get to checkpoint, and the
forker's death would kill them, `die_with_parent`); each child gets the default handlers back.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

FORK_ENV = "TOPOTRAIN_RANK_FORKER"  # "<fd>": this process is the pod's forker; its replies go to fd
FORKER_COMM = "topotrain-fork"  # the forker's process name (/proc/PID/comm): not a rank
START_SECONDS = 600.0  # the forker's imports, at most, before its first child (a busy node)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def set_process_name(name: str) -> None:
    """Set /proc/self/comm (15 bytes), on Linux: how `ps -o comm` and fault injectors tell the
    forker (and the bundled trainer's warm spares) from a rank."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_name = 15
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; a fork clears it)."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    parent = os.getppid()  # may be PID 1: the launcher is the container's first process
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def serve(requests: int = 0) -> dict[str, str] | None:
    """The forker's loop (see the module's docstring); `requests` is the fd of its stdin."""
    reply_fd = int(os.environ.pop(FORK_ENV))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    children: set[int] = set()
    pending = b""

    def send(message: dict[str, object]) -> None:
        with contextlib.suppress(BrokenPipeError):  # the supervisor is gone: its end of input follows
            os.write(reply_fd, json.dumps(message).encode() + b"\n")

    while True:
        while children:  # reap, and tell the supervisor
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            break
        if b"\n" not in pending:
            if not select.select([requests], [], [], 0.1)[0]:
                continue
            chunk = os.read(requests, 65536)
            if not chunk:  # let go: the children die with this process (die_with_parent)
                return None
            pending += chunk
            continue
        line, pending = pending.split(b"\n", 1)
        if (threads := _threads()) > 1:
            send({"refused": f"the forker runs {threads} threads; a fork copies only one"})
            continue
        env = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(reply_fd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, requests)
            os.close(devnull)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.environ.clear()
            os.environ.update(env)
            die_with_parent()  # the forker
            _intra_op_threads(env)
            return dict(env)
        children.add(pid)
        send({"forked": pid})


def _intra_op_threads(env: Mapping[str, str]) -> None:
    """Give a forked rank the intra-op threads a new interpreter with `env` would have: the forker
    imported torch with one (`Forker`), and torch reads OMP_NUM_THREADS only when it is imported;
    without one, torch's default is a thread per CPU this process may run on."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    raw = env.get("OMP_NUM_THREADS", "")
    want = int(raw) if raw.isdigit() and int(raw) > 0 else len(os.sched_getaffinity(0))
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)


class ForkedRank:
    """A forked child, as the supervisor sees it: the subset of `subprocess.Popen` it uses."""

    def __init__(self, forker: Forker, pid: int) -> None:
        self.forker, self.pid = forker, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.forker.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forker:
    """The supervisor's end: one forker process per pod, started at the first `spawn`."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        read, write = os.pipe()
        # One OpenMP thread while it imports: torch starts its OpenMP pool at import (a thread per
        # CPU by default), and a process running threads may not fork. Each child gets its own
        # rank's thread count back (`_intra_op_threads`).
        self.process = subprocess.Popen(list(argv), env={**env, "OMP_NUM_THREADS": "1", FORK_ENV: str(write)},
                                        stdin=subprocess.PIPE, pass_fds=(write,))  # fmt: skip
        os.close(write)
        os.set_blocking(read, False)
        self.replies, self.pending = read, b""
        self.ranks: dict[int, ForkedRank] = {}  # running, by pid
        self.forked: list[ForkedRank] = []  # reported by the forker, not yet handed out
        self.refused: str | None = None
        self.closed = False

    def alive(self) -> bool:
        return not self.closed and self.process.poll() is None

    def spawn(self, env: Mapping[str, str], timeout: float = START_SECONDS) -> ForkedRank | None:
        """A child running as a rank with `env`; None when the forker refused or is gone."""
        if not self.alive() or self.process.stdin is None:
            return None
        try:
            self.process.stdin.write(json.dumps(dict(env)).encode() + b"\n")
            self.process.stdin.flush()
        except OSError:
            self._gone()
            return None
        deadline = time.monotonic() + timeout
        while not self.forked and self.refused is None and not self.closed and time.monotonic() < deadline:
            select.select([self.replies], [], [], 0.5)
            self.collect()
        if self.refused is not None or not self.forked:
            self.refused = None
            return None
        return self.forked.pop(0)

    def collect(self) -> None:
        """Read the forker's replies that have arrived (never blocks)."""
        while not self.closed:
            try:
                chunk = os.read(self.replies, 65536)
            except BlockingIOError:
                break
            if not chunk:
                self._gone()
                break
            self.pending += chunk
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            reply = json.loads(line)
            if "forked" in reply:  # (its exit may follow in the same read)
                rank = ForkedRank(self, int(reply["forked"]))
                self.ranks[rank.pid] = rank
                self.forked.append(rank)
            elif "exited" in reply and int(reply["exited"]) in self.ranks:
                self.ranks.pop(int(reply["exited"])).returncode = int(reply["code"])
            elif "refused" in reply:
                self.refused = str(reply["refused"])

    def _gone(self) -> None:
        """The forker died: its children die with it (die_with_parent); make sure, and say so."""
        self.closed = True
        for rank in self.ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signal.SIGKILL)
            rank.returncode = -signal.SIGKILL
        self.ranks.clear()

    def close(self) -> None:
        """Let the forker go (end of its input), then make sure it has."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.collect()
        if not self.closed:
            self._gone()
        os.close(self.replies)


def python_command(command: Sequence[str]) -> list[str] | None:
    """`python script.py ...` or `python -m module ...` as the forker's arguments (`main`), or
    None when `command` is not a Python interpreter running a script or module."""
    if len(command) < 2 or not os.path.basename(command[0]).startswith("python"):
        return None
    if (command[1] == "-m" and len(command) > 2) or not command[1].startswith("-"):
        return list(command[1:])
    return None


USAGE = "usage: python -m topotrain_sdk.forker [--preload mod,...] (script.py | -m module) [args ...]"


def main(argv: Sequence[str] | None = None) -> int:
    """A forker for any Python trainer (run by `topotrain-launch --fork`, see the docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    preload = ["torch"]
    if args[:1] == ["--preload"] and len(args) > 1:
        preload, args = [m for m in args[1].split(",") if m], args[2:]
    if not args or (args[0] == "-m" and len(args) < 2):
        print(USAGE, file=sys.stderr)
        return 2
    if FORK_ENV in os.environ:  # else a rank started as a new interpreter (forking failed)
        die_with_parent()
        set_process_name(FORKER_COMM)
        for name in preload:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        if serve() is None:
            return 0
        set_process_name(os.path.basename(sys.executable))
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
