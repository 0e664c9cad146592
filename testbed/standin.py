"""A stand-in trainer for the chaos soak. It is not the trainer: no model, no
torch, no GPUs. It speaks the trainer's contract with the operator, so the
soak can run many jobs on two cores:

- reads the pod environment (topotrain.contract.TrainerEnv) and the job's
  `spec.training` (TOPOTRAIN_TRAINING_CONFIG): `steps`, `stepSeconds`, `seed`;
- the gang is lock-step, like a collective: node rank 0 listens on
  MASTER_PORT, every other rank connects and acknowledges each step, so one
  lost rank ends the whole attempt (rank 0 exits 1 on a lost peer, a peer
  exits 1 on a lost rank 0) and one frozen rank stalls it;
- node rank 0 resumes from TOPOTRAIN_RESUME_STEP (loading the state saved in
  that step's checkpoint), writes progress.json every step and, every
  `intervalSteps`, a checkpoint (one `state.json` shard, then COMMITTED,
  then retention), all through topotrain.checkpoints so the layout is the
  real one; a new `topotrain.io/checkpoint-request` value in the control
  file is served like the trainer serves it (a save of the current step whose
  COMMITTED and heartbeat name the request), so a resize goes the
  checkpoint-first way without waiting for the bound;
- the "loss" of step n is a pure function of the state chain
  seed -> step 1 -> ... -> step n, so a run resumed from the right committed
  checkpoint prints exactly the losses of an uninterrupted run, and one
  resumed from anything else does not;
- `holdAtStep`/`holdAttempts` hold the first attempts after that step until the pod's
  hold-release annotation (a test aid, as the trainer's; a run resumed past the step goes on);
- SIGUSR1 makes it crash (exit 1), as an exception in a training step would;
  it exits 0 after the last step;
- like the trainer's pod, it runs under the trainer's own pod supervisor
  (topotrain_trainer.supervisor, no torch needed): the pod's first process is
  the supervisor, the stand-in runs as its worker; a worker that lost its
  peer exits EXIT_PEER_LOST (76), which leaves the pod up for the operator's
  restart in place, and a new attempt in the control file restarts it.

It runs as a script (`python testbed/standin.py`): the pod process harness
puts only the product packages on PYTHONPATH, as the trainer image would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

RENDEZVOUS_SECONDS = 120.0
COLLECTIVE_SECONDS = 600.0  # a frozen peer stalls the gang this long, as an NCCL timeout would
CHECKPOINT_GIVE_UP_SECONDS = 180.0
STATE_SHARD = "state.json"
EXIT_PEER_LOST = 76  # the trainer's code for "a collective lost a peer in another pod"


def next_state(seed: int, state: int, step: int) -> int:
    digest = hashlib.sha256(f"{seed}:{state}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def loss_of(state: int) -> float:
    return round(1.0 + (state % 1_000_000) / 1_000_000, 6)


def expected_losses(seed: int, steps: int) -> dict[int, float]:
    """The losses of an uninterrupted run: what every resumed run must print too."""
    state, out = seed, {}
    for step in range(1, steps + 1):
        state = next_state(seed, state, step)
        out[step] = loss_of(state)
    return out


def emit(**event: Any) -> None:
    print(json.dumps({"time": time.time(), **event}), flush=True)


def _crash(signum: int, _frame: object) -> None:
    emit(event="crash", signal=signum)
    os._exit(1)


def _lines(conn: socket.socket) -> Any:
    buffer = b""
    while True:
        chunk = conn.recv(4096)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode()


def run_peer(addr: str, port: int, rank: int) -> int:
    deadline = time.monotonic() + RENDEZVOUS_SECONDS
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                emit(event="exit", reason="rendezvous timed out", rank=rank)
                return EXIT_PEER_LOST
            time.sleep(0.5)
    conn.settimeout(None)
    try:
        for line in _lines(conn):
            if line == "done":
                return 0
            conn.sendall(f"ok {line}\n".encode())
    except OSError as err:  # a reset connection is rank 0 gone too, as gloo reports a peer lost
        emit(event="exit", reason=f"lost node rank 0: {err}", rank=rank)
        return EXIT_PEER_LOST
    emit(event="exit", reason="lost node rank 0", rank=rank)
    return EXIT_PEER_LOST


def _rendezvous(port: int, peers: int) -> list[socket.socket]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(max(peers, 1))
    server.settimeout(RENDEZVOUS_SECONDS)
    conns = []
    for _ in range(peers):
        conn, _addr = server.accept()
        conn.settimeout(COLLECTIVE_SECONDS)
        conns.append(conn)
    server.close()
    return conns


def _collective(conns: list[socket.socket], step: int) -> bool:
    try:
        for conn in conns:
            conn.sendall(f"{step}\n".encode())
        for conn in conns:
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(64)
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    return True


def _retry(what: str, call: Any) -> Any:
    deadline = time.monotonic() + CHECKPOINT_GIVE_UP_SECONDS
    while True:
        try:
            return call()
        except Exception as err:  # the store is down or erroring: try again, as the trainer does
            if time.monotonic() > deadline:
                raise
            emit(event="store-error", what=what, error=str(err)[:200])
            time.sleep(1)


def _hold(step: int, serve: Callable[[str], None]) -> None:
    """`training.holdAtStep` (a test aid, as the trainer's): after that step's heartbeat (and its
    commit, when one is due) wait until the pod's hold-release annotation shows in the control file,
    serving checkpoint requests meanwhile as the trainer does (`serve(request)` saves the held
    step naming it). Only the step itself holds: a run resumed past it goes on."""
    from topotrain.contract import CHECKPOINT_REQUEST, HOLD_RELEASE, control_path, read_control

    emit(event="hold", step=step)
    while True:
        control = read_control(control_path())
        if control.get(HOLD_RELEASE):
            break
        serve(control.get(CHECKPOINT_REQUEST, ""))
        time.sleep(0.2)
    emit(event="released", step=step)


class _Saver:
    """Rank 0's checkpoints: periodic ones and those the operator asks for, each committed through
    topotrain.checkpoints; remembers the last request served so that one is saved only once."""

    def __init__(self, env: Any, store: Any, served: Any) -> None:
        self.env, self.store, self.served = env, store, served

    def new_request(self, asked: str) -> bool:
        return bool(asked) and (self.served is None or asked != self.served.value)

    def save(self, step: int, state: int, asked: str = "") -> None:
        from topotrain.checkpoints import ServedRequest

        env, store = self.env, self.store
        requested = self.new_request(asked)
        doc = json.dumps({"step": step, "state": state}).encode()
        key = f"{store.step_key(step)}/{STATE_SHARD}"
        if requested:
            self.served = ServedRequest(asked, step)
        request = self.served.value if self.served is not None else ""
        _retry("shard", lambda: store.client.put_object(Bucket=store.bucket, Key=key, Body=doc))
        _retry(
            "commit",
            # the attempt, as the trainer records it: a restart after a planned change never
            # resumes from a step the replaced gang saved after the change's step (its floor)
            lambda: store.write_commit(
                step, {"dp": env.data}, len(doc), request=request, attempt=env.attempt
            ),
        )
        _retry("retention", lambda: store.apply_retention(env.checkpoint_keep))
        emit(event="commit", step=step, attempt=env.attempt, request=asked if requested else "")

    def serve(self, step: int, state: int, asked: str) -> None:
        """A request read while held at `step`: saved once, naming it, and the heartbeat says so."""
        if self.new_request(asked):
            self.save(step, state, asked)
            self.heartbeat(step)

    def heartbeat(self, step: int) -> None:
        try:
            self.store.write_progress(step, self.env.attempt, request=self.served)
        except Exception as err:  # the heartbeat is best effort; the next step writes it again
            emit(event="store-error", what="progress", error=str(err)[:200])


def run_rank0(env: Any, config: dict[str, Any]) -> int:
    from topotrain.checkpoints import CheckpointStore, ServedRequest
    from topotrain.contract import CHECKPOINT_REQUEST, control_path, read_control

    steps, pace = int(config.get("steps", 100)), float(config.get("stepSeconds", 1.0))
    hold_at, hold_attempts = int(config.get("holdAtStep", 0)), int(config.get("holdAttempts", 1))
    seed = int(config.get("seed", 0))
    store = CheckpointStore(env.checkpoint_uri)
    state, start = seed, 1
    served: ServedRequest | None = None  # the last checkpoint request this run's state served
    if env.resume_step is not None:
        resumed = _retry("commit", lambda: store.read_commit(env.resume_step))
        if resumed is not None and resumed.request:
            served = ServedRequest(resumed.request, env.resume_step)
        body = _retry(
            "load",
            lambda: store.client.get_object(
                Bucket=store.bucket, Key=f"{store.step_key(env.resume_step)}/{STATE_SHARD}"
            )["Body"].read(),
        )
        saved = json.loads(body)
        if int(saved["step"]) != env.resume_step:
            emit(event="exit", reason=f"checkpoint {env.resume_step} holds step {saved['step']}")
            return 1
        state, start = int(saved["state"]), env.resume_step + 1
        emit(event="restored", step=env.resume_step, attempt=env.attempt)
    emit(event="start", attempt=env.attempt, resume=env.resume_step, data=env.data, pods=env.nnodes)
    try:  # retention once as the attempt starts, as the trainer does (Checkpointer.tidy)
        store.apply_retention(env.checkpoint_keep)
    except Exception as err:  # best effort: the next commit's retention tries again
        emit(event="store-error", what="retention", error=str(err)[:200])
    try:
        conns = _rendezvous(env.master_port, env.nnodes - 1)
    except OSError as err:
        emit(event="exit", reason=f"rendezvous failed: {err}")
        return EXIT_PEER_LOST
    saver = _Saver(env, store, served)
    for step in range(start, steps + 1):
        time.sleep(pace)
        if not _collective(conns, step):
            emit(event="exit", reason="lost a peer", step=step)
            return EXIT_PEER_LOST
        state = next_state(seed, state, step)
        emit(event="step", step=step, loss=loss_of(state), attempt=env.attempt)
        # A checkpoint request (the operator's annotation, read through the control file, as the
        # trainer does at every step boundary): save this step, naming the request, and go on.
        asked = read_control(control_path()).get(CHECKPOINT_REQUEST, "")
        if (
            bool(env.checkpoint_interval) and step % env.checkpoint_interval == 0
        ) or saver.new_request(asked):
            saver.save(step, state, asked)
        saver.heartbeat(step)
        if step == hold_at and env.attempt < hold_attempts:
            _hold(step, lambda asked, held=step, now=state: saver.serve(held, now, asked))
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.sendall(b"done\n")
    emit(event="done", attempt=env.attempt)
    return 0


def main() -> int:
    from topotrain.contract import TrainerEnv, control_path

    env = TrainerEnv.from_env()
    if "LOCAL_RANK" not in os.environ:  # the pod's first process: the trainer's supervisor
        from topotrain_trainer.supervisor import Supervisor, peer_wait_seconds

        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a crash is the worker's, not the pod's
        worker = [sys.executable, os.path.abspath(__file__)]
        return Supervisor(env, control_path(), worker_argv=worker,
                          peer_wait=peer_wait_seconds(os.environ)).run()  # fmt: skip
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return 0  # one process per pod speaks for it: the supervisor starts NPROC_PER_NODE ranks
    signal.signal(signal.SIGUSR1, _crash)
    config = json.loads(os.environ.get("TOPOTRAIN_TRAINING_CONFIG", "{}") or "{}")
    if env.node_rank:
        return run_peer(env.master_addr, env.master_port, env.node_rank)
    try:
        return run_rank0(env, config)
    except Exception as err:
        emit(event="exit", reason=f"{type(err).__name__}: {err}"[:300])
        return 1


if __name__ == "__main__":
    sys.exit(main())
