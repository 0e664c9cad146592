"""The pod's supervisor: runs the local worker group and restarts it in place on a new attempt.

`topotrain-launch -- <command>` (launch.py) and the bundled trainer's `python -m
topotrain_trainer` outside torchrun both become this supervisor. It
starts the pod's NPROC_PER_NODE ranks as child processes (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in their environment, as torchrun would
set them; they rendezvous through torch's env:// TCPStore on rank 0), with the
attempt, resume step and rank-0 address of the control file
(`topotrain_sdk.contract.control_path()`, the pod's annotations as a downwardAPI
volume) when it names an attempt, else of the pod's environment.

Rules, checked every `poll` seconds:

- every worker exited 0: exit 0; a worker exited 78 (bad configuration): exit 78;
- the control file's attempt went up: stop the workers (SIGTERM, SIGKILL after
  `grace` s) and start them again for that attempt: the operator restarts the
  gang in place, keeping this pod;
- a worker failed: once the local group has settled, if every failed worker
  exited EXIT_PEER_LOST (76: a collective lost a peer in another pod), this pod
  is healthy: stay up and wait for the operator's next attempt, at most
  `peer_wait` s (then exit 76); otherwise exit with the failed worker's code
  (128 + signal for a signal), so the pod Fails and the operator sees it;
- with warm spares (or `keep_pod_on_failure`, the launcher's default) and a failure reporter (`report`: the pod's checkpoint store, where
  the operator reads `failure.json`), a worker's own failure (not a bad configuration) is
  reported instead and the supervisor waits like a healthy pod (either wait starts the
  spares at once if they were not due yet): the operator restarts
  the gang in place keeping this pod too, and the spares take the ranks, so no rank of
  the next attempt pays a fresh interpreter. If the report cannot be written, or no
  next attempt comes within `peer_wait` s, it exits with the failed worker's code;
- SIGTERM/SIGINT: forwarded to the workers (they may checkpoint); the supervisor
  exits when they have.

Warm spares (`training.warmSpares`): `spare_delay` seconds after a worker group
starts, the supervisor starts one spare process per local rank that imports
torch and the trainer and then waits on its stdin. The next in-place restart
hands each spare its rank's environment (one JSON line) instead of starting a
new interpreter, so the restarted attempt skips the imports; a spare that died
is replaced by a fresh process. Spares cost host memory (one more interpreter
with torch per local rank), nothing else; the supervisor lets them go (EOF on
stdin, then SIGKILL) whenever it exits.

Forked ranks (`fork_ranks`, the bundled trainer's default; `forker.py`): the ranks are forked
from one interpreter per pod that imported the trainer once, instead of each starting a fresh
interpreter; where the forker refuses or is gone, a rank starts as a fresh interpreter as above.

The workers stay in the supervisor's process group, so whoever signals the pod's
group reaches them too, and each asks the kernel to kill it if the supervisor
dies (`die_with_parent`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Protocol

from topotrain_sdk.contract import (
    EXIT_BAD_CONFIG,
    EXIT_PEER_LOST,
    ContractError,
    TrainerEnv,
    read_control,
    with_control,
)
from topotrain_sdk.forker import Forker

SPARE_ENV = "TOPOTRAIN_WARM_SPARE"  # "1": the process is a warm spare (await_activation)
POLL_SECONDS = 0.5
ATTEMPT_GRACE_SECONDS = 3.0  # an abandoned attempt's workers have nothing worth saving
SETTLE_SECONDS = 5.0  # after a first worker failure, how long the others get to fail too
PEER_WAIT_SECONDS = 600.0
PEER_WAIT_ENV = "TOPOTRAIN_PEER_WAIT_SECONDS"
SPARE_DELAY_SECONDS = 30.0  # after a group starts: its own start (imports, rendezvous) goes first
SPARE_DELAY_ENV = "TOPOTRAIN_WARM_SPARE_DELAY_SECONDS"


def await_activation(stream: IO[str] | None = None) -> dict[str, str] | None:
    """A warm spare's wait: the environment of the rank it is to run (one JSON object on a line
    from the supervisor), or None when the supervisor let it go (end of input)."""
    line = (stream or sys.stdin).readline()
    if not line.strip():
        return None
    env = json.loads(line)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ContractError("a warm spare's activation must be a JSON object of strings")
    return env


def thread_env(base: Mapping[str, str], nproc_per_node: int) -> dict[str, str]:
    """The pod's environment with torchrun's thread default: with more than one local rank and
    no OMP_NUM_THREADS of the pod's own, each rank gets one OpenMP thread (else every rank
    starts a thread per core of the node and the ranks oversubscribe its CPUs). Spares get it
    too: torch reads it when it is imported."""
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        return {**base, "OMP_NUM_THREADS": "1"}
    return dict(base)


def worker_env(base: Mapping[str, str], env: TrainerEnv, local_rank: int) -> dict[str, str]:
    """One rank's environment: the pod's, the attempt's contract, torch's env:// rendezvous."""
    rank = env.node_rank * env.nproc_per_node + local_rank
    return {
        **thread_env(base, env.nproc_per_node), **env.to_env(),
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.nproc_per_node), "GROUP_RANK": str(env.node_rank),
        "MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port),
    }  # fmt: skip


def exit_status(code: int) -> int:
    """A process's status as a shell reports it: 128 + N when killed by signal N."""
    return 128 - code if code < 0 else code


class Process(Protocol):
    """A worker: a `subprocess.Popen` or a forked rank (`forker.ForkedRank`)."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


@dataclass
class WorkerGroup:
    """The pod's local ranks of one attempt."""

    attempt: int
    processes: list[Process] = field(default_factory=list)
    failed_at: float | None = None  # monotonic time of the first failure seen

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.processes]

    def signal(self, sig: signal.Signals) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL whatever is left after `grace` seconds; reap them all."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)  # a stopped (hung) worker must see it too
        deadline = time.monotonic() + grace
        while any(c is None for c in self.codes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
        for process in self.processes:
            process.wait()


class Supervisor:
    def __init__(
        self,
        env: TrainerEnv,
        control: Path,
        *,
        worker_argv: Sequence[str],
        base_env: Mapping[str, str] | None = None,
        poll: float = POLL_SECONDS,
        grace: float = ATTEMPT_GRACE_SECONDS,
        settle: float = SETTLE_SECONDS,
        peer_wait: float = PEER_WAIT_SECONDS,
        warm_spares: bool = False,
        spare_delay: float = SPARE_DELAY_SECONDS,
        emit: Callable[[dict[str, object]], None] | None = None,
        report: Callable[[int, int], None] | None = None,
        keep_pod_on_failure: bool = False,
        fork_ranks: bool = False,
    ) -> None:
        self.env, self.control = env, control
        self.worker_argv = list(worker_argv)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.poll, self.grace, self.settle, self.peer_wait = poll, grace, settle, peer_wait
        self.warm_spares, self.spare_delay = warm_spares, spare_delay
        self.emit = emit or _print_json
        self.report = report  # (attempt, exit code) -> None: tell the operator, or raise
        # Report an own worker's failure and wait even without warm spares (a fresh interpreter
        # takes the ranks of the next attempt): the pod is kept for an in-place restart.
        self.keep_pod_on_failure = keep_pod_on_failure
        self.failed_code: int | None = None  # the own failure reported, while waiting
        self.stop_signal: int | None = None
        self.group: WorkerGroup | None = None
        self.spares: list[subprocess.Popen[bytes]] = []
        self.spares_due: float | None = None  # monotonic time to start the next spares
        self.fork_ranks = fork_ranks  # worker_argv serves forks (forker.serve) when FORK_ENV is set
        self.forker: Forker | None = None

    def desired(self) -> TrainerEnv:
        """The attempt the control file asks for; the pod's environment where it says nothing."""
        try:
            return with_control(self.env, read_control(self.control))
        except ContractError as err:
            self.emit({"event": "control_invalid", "error": str(err)})
            return self.env

    def start(self, env: TrainerEnv) -> WorkerGroup:
        group = WorkerGroup(env.attempt)
        warm = forked = 0
        for local_rank in range(env.nproc_per_node):
            rank_env = worker_env(self.base_env, env, local_rank)
            process: Process | None = self._activate_spare(rank_env)
            if process is not None:
                warm += 1
            elif (process := self._fork(rank_env)) is not None:
                forked += 1
            else:
                process = subprocess.Popen(self.worker_argv, env=rank_env)
            group.processes.append(process)
        self.release_spares()  # none should be left; a smaller group never reuses stale ones
        if self.warm_spares:
            self.spares_due = time.monotonic() + self.spare_delay
        self.emit({"event": "workers_started", "attempt": env.attempt, "workers": env.nproc_per_node,
                   "master": f"{env.master_addr}:{env.master_port}",
                   "resume_step": env.resume_step, "warm": warm, "forked": forked})  # fmt: skip
        self.group = group
        return group

    def _fork(self, rank_env: Mapping[str, str]) -> Process | None:
        """A rank forked from the pod's forker (started at the first); None when forking is off
        or failed (then off for good: the ranks start as fresh interpreters)."""
        if not self.fork_ranks:
            return None
        if self.forker is None:
            self.forker = Forker(self.worker_argv, thread_env(self.base_env, self.env.nproc_per_node))
        rank = self.forker.spawn(rank_env)
        if rank is None:
            self.fork_ranks = False
            self.emit({"event": "fork_failed", "forker_alive": self.forker.alive()})
        return rank

    def _activate_spare(self, rank_env: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
        """A live spare, told `rank_env`; None when there is none (or none took it)."""
        while self.spares:
            spare = self.spares.pop(0)
            if spare.poll() is None and spare.stdin is not None:
                try:
                    spare.stdin.write(json.dumps(dict(rank_env)).encode() + b"\n")
                    spare.stdin.close()
                    return spare
                except OSError:  # it died between the poll and the write
                    pass
            _kill(spare)
        return None

    def start_spares_when_due(self) -> None:
        if self.spares_due is None or time.monotonic() < self.spares_due:
            return
        self.spares_due = None
        for _ in range(self.env.nproc_per_node):
            self.spares.append(subprocess.Popen(
                self.worker_argv, env={**thread_env(self.base_env, self.env.nproc_per_node), SPARE_ENV: "1"},
                stdin=subprocess.PIPE,
            ))  # fmt: skip
        self.emit({"event": "spares_started", "spares": len(self.spares)})

    def release_spares(self) -> None:
        """Let every spare go: end of input (a spare waiting on it exits 0), then SIGKILL."""
        spares, self.spares = self.spares, []
        for spare in spares:
            if spare.stdin is not None:
                with contextlib.suppress(OSError):
                    spare.stdin.close()
        for spare in spares:
            _kill(spare)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stop_signal = signum

    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        current = self.desired()
        group = self.start(current)
        waiting_since: float | None = None  # healthy, waiting for the operator's next attempt
        try:
            while True:
                if self.stop_signal is not None:
                    return self._forward_stop(group)
                wanted = self.desired()
                if wanted.attempt > current.attempt:
                    self.emit({"event": "attempt_changed", "from": current.attempt,
                               "to": wanted.attempt})  # fmt: skip
                    group.stop(self.grace)
                    current, waiting_since, self.failed_code = wanted, None, None
                    group = self.start(current)
                    continue
                self.start_spares_when_due()
                if waiting_since is None:
                    verdict = self._judge(group)
                    if verdict is not None and verdict not in (0, EXIT_PEER_LOST, EXIT_BAD_CONFIG):
                        verdict = self._reported(current.attempt, verdict)
                    if verdict is not None and verdict != EXIT_PEER_LOST:
                        return verdict
                    if verdict == EXIT_PEER_LOST:
                        waiting_since = time.monotonic()
                        if self.spares_due is not None:
                            self.spares_due = waiting_since  # not due yet: the next attempt needs them
                        self.emit({"event": "peer_lost" if self.failed_code is None else "failure_reported",
                                   "attempt": current.attempt, "wait_seconds": self.peer_wait})  # fmt: skip
                elif time.monotonic() - waiting_since > self.peer_wait:
                    self.emit({"event": "peer_wait_expired", "attempt": current.attempt})
                    return EXIT_PEER_LOST if self.failed_code is None else self.failed_code
                time.sleep(self.poll)
        finally:
            self.release_spares()
            if self.group is not None:
                self.group.stop(self.grace)
            if self.forker is not None:
                self.forker.close()

    def _judge(self, group: WorkerGroup) -> int | None:
        """None while the group trains; else the supervisor's exit (EXIT_PEER_LOST: wait)."""
        codes = group.codes()
        failed = [c for c in codes if c not in (None, 0)]
        if not failed:
            return 0 if all(c == 0 for c in codes) else None
        now = time.monotonic()
        if group.failed_at is None:
            group.failed_at = now
        if any(c is None for c in codes) and now - group.failed_at < self.settle:
            return None  # the other local ranks are likely failing too: judge them together
        own = [exit_status(c) for c in failed if c != EXIT_PEER_LOST]
        group.stop(self.grace)
        if not own:
            return EXIT_PEER_LOST
        code = EXIT_BAD_CONFIG if EXIT_BAD_CONFIG in own else own[0]
        self.emit({"event": "workers_failed", "attempt": group.attempt, "exit_code": code,
                   "codes": [None if c is None else exit_status(c) for c in codes]})  # fmt: skip
        return code

    def _reported(self, attempt: int, code: int) -> int:
        """An own worker failed with `code`: EXIT_PEER_LOST (wait for the next attempt) once the
        operator is told and a warm spare (or a fresh process) can take over, else `code`."""
        if self.report is None or not (self.warm_spares or self.keep_pod_on_failure):
            return code
        try:
            self.report(attempt, code)
        except Exception as err:  # the store is unreachable: the pod's failure tells the operator
            self.emit({"event": "failure_report_failed", "attempt": attempt, "error": str(err)[:300]})
            return code
        self.failed_code = code
        return EXIT_PEER_LOST

    def _forward_stop(self, group: WorkerGroup) -> int:
        """The pod is being stopped: pass the signal on and wait for the workers (they may save)."""
        sig = self.stop_signal or signal.SIGTERM
        self.release_spares()
        self.emit({"event": "stopping", "signal": signal.Signals(sig).name, "attempt": group.attempt})
        group.signal(signal.Signals(sig))
        group.signal(signal.SIGCONT)
        for process in group.processes:
            process.wait()  # the kubelet's SIGKILL ends this wait after the pod's grace period
        codes = [exit_status(c) for c in group.codes() if c is not None]
        return next((c for c in codes if c != 0), 0)


def _kill(process: Process) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    process.wait()


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    try:
        return max(0.0, float(raw)) if raw else default
    except ValueError:
        return default


def peer_wait_seconds(env: Mapping[str, str]) -> float:
    return _seconds(env, PEER_WAIT_ENV, PEER_WAIT_SECONDS)


def _print_json(event: dict[str, object]) -> None:
    print(json.dumps({**event, "source": "supervisor"}), flush=True)


def store_reporter(env: TrainerEnv, pod: str) -> Callable[[int, int], None] | None:
    """Reports an own worker's failure to the job's checkpoint store (failure.json), where the
    operator reads it; None without a checkpoint store."""
    if not env.checkpoint_uri:
        return None

    def report(attempt: int, code: int) -> None:
        from datetime import UTC, datetime

        from topotrain_sdk.checkpoints import CheckpointStore, WorkerFailure

        CheckpointStore(env.checkpoint_uri).write_failure(
            WorkerFailure(attempt, env.node_rank, code, datetime.now(UTC), pod))

    return report


def supervise(
    env: TrainerEnv, control: Path, worker_argv: Sequence[str], *, warm_spares: bool = False,
    keep_pod_on_failure: bool = False, fork_ranks: bool = False,
) -> int:
    """Run `worker_argv` as the pod's local ranks until done (the pod's exit status)."""
    return Supervisor(env, control, worker_argv=worker_argv, peer_wait=peer_wait_seconds(os.environ),
                      warm_spares=warm_spares, keep_pod_on_failure=keep_pod_on_failure,
                      fork_ranks=fork_ranks,
                      spare_delay=_seconds(os.environ, SPARE_DELAY_ENV, SPARE_DELAY_SECONDS),
                      report=store_reporter(env, os.environ.get("HOSTNAME", ""))).run()  # fmt: skip
