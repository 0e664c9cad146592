"""The pod supervisor (topotrain_trainer.supervisor) with fake workers.

The one test double is the worker command: a tiny Python script standing in
for a rank, whose behaviour per attempt and local rank is given in the
FAKE_PLAN environment variable. The control file is a real file in the
kubelet's downwardAPI format.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from topotrain.contract import (
    ATTEMPT_ANNOTATION,
    MASTER_ADDR_ANNOTATION,
    RESUME_STEP_ANNOTATION,
    TrainerEnv,
    format_control,
    read_control,
    with_control,
)
from topotrain_trainer.supervisor import EXIT_PEER_LOST, Supervisor, worker_env

# FAKE_PLAN: {"<attempt>/<local rank>": "exit:N" | "sleep" | "sleep_then:N"}; each start is logged.
FAKE_WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    if os.environ.get("TOPOTRAIN_RANK_FORKER"):  # the pod's forker: fork each rank asked for
        from topotrain_sdk.forker import serve
        if os.environ.get("FAKE_FORKER_THREAD"):  # a forker that runs a thread may not fork
            import threading
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        if serve() is None:
            sys.exit(0)
    warm = os.environ.get("TOPOTRAIN_WARM_SPARE") == "1"
    if warm:  # a warm spare: wait to be told which rank to be, as the trainer's does
        from topotrain_trainer.supervisor import await_activation
        told = await_activation()
        if told is None:
            sys.exit(0)
        os.environ.clear()
        os.environ.update(told)
    attempt, local = os.environ["TOPOTRAIN_ATTEMPT"], os.environ["LOCAL_RANK"]
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(json.dumps({"attempt": int(attempt), "rank": int(os.environ["RANK"]),
                              "master": os.environ["MASTER_ADDR"], "pid": os.getpid(), "warm": warm,
                              "parent": os.getppid(),
                              "resume": os.environ["TOPOTRAIN_RESUME_STEP"]}) + "\\n")
    action = json.loads(os.environ["FAKE_PLAN"]).get(f"{attempt}/{local}", "exit:0")
    if action.startswith("exit:"):
        sys.exit(int(action[5:]))
    if action.startswith("sleep_then:"):
        time.sleep(0.5)
        sys.exit(int(action[11:]))
    if action == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
""")

ENV = TrainerEnv(master_addr="job-0-0.job.ns.svc", master_port=29500, nnodes=2, node_rank=1,
                 nproc_per_node=2, tensor=1, pipeline=2, data=2)  # fmt: skip


def supervisor(tmp_path: Path, plan: dict[str, str], **kwargs: float | bool) -> Supervisor:
    base = {**os.environ, "FAKE_PLAN": json.dumps(plan), "FAKE_LOG": str(tmp_path / "starts")}
    if kwargs.pop("forker_thread", False):
        base["FAKE_FORKER_THREAD"] = "1"
    options = {"poll": 0.05, "grace": 1.0, "settle": 1.0, "peer_wait": 30.0, **kwargs}
    return Supervisor(ENV, tmp_path / "annotations", worker_argv=[sys.executable, "-c", FAKE_WORKER],
                      base_env=base, emit=lambda _: None, **options)  # fmt: skip


def starts(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "starts"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_control(tmp_path: Path, attempt: int, resume: str = "", master: str = "") -> None:
    annotations = {ATTEMPT_ANNOTATION: str(attempt), RESUME_STEP_ANNOTATION: resume,
                   MASTER_ADDR_ANNOTATION: master, "other.io/x": 'say "hi"\n'}  # fmt: skip
    staged = tmp_path / "annotations.tmp"
    staged.write_text(format_control(annotations))
    staged.replace(tmp_path / "annotations")  # the kubelet swaps the file atomically too


def run_in_thread(sup: Supervisor) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    thread.start()
    return thread, result


# Liveness bounds, not speeds: a passing run returns as soon as its condition holds. CI runs the
# unit tests beside the kind stage and the Kueue suite, where starting a worker interpreter has
# taken more than 20 s (CI, 2026-12-06: a wait for four worker starts timed out at 20 s).
LIVENESS = 120.0


def wait_for(predicate: object, timeout: float = LIVENESS) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)
    assert predicate(), "timed out"  # type: ignore[operator]


def test_the_control_file_parses_as_the_kubelet_writes_it(tmp_path: Path) -> None:
    text = 'topotrain.io/attempt="3"\ntopotrain.io/master-addr="job-3-0.job.ns.svc"\nx="a\\"b\\nc"\n'
    (tmp_path / "a").write_text(text)
    assert read_control(tmp_path / "a") == {"topotrain.io/attempt": "3",
                                            "topotrain.io/master-addr": "job-3-0.job.ns.svc", "x": 'a"b\nc'}  # fmt: skip
    (tmp_path / "b").write_text(format_control({"k": 'v "w"'}))
    assert read_control(tmp_path / "b") == {"k": 'v "w"'}
    assert read_control(tmp_path / "missing") == {}
    env = with_control(ENV, {ATTEMPT_ANNOTATION: "4", RESUME_STEP_ANNOTATION: "8",
                             MASTER_ADDR_ANNOTATION: "job-2-0.job.ns.svc"})  # fmt: skip
    assert (env.attempt, env.resume_step, env.master_addr) == (4, 8, "job-2-0.job.ns.svc")
    assert with_control(ENV, {}) == ENV  # no control file: the environment, as before


def test_worker_environment_is_the_rendezvous_torchrun_would_give() -> None:
    env = worker_env({"PATH": "/bin"}, ENV, 1)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("3", "1", "4", "29500")
    assert env["PATH"] == "/bin" and env["TOPOTRAIN_ATTEMPT"] == "0"
    # torchrun's thread default: one OpenMP thread per rank of a multi-rank pod, unless the pod
    # says otherwise; a one-rank pod keeps torch's own default
    assert env["OMP_NUM_THREADS"] == "1"
    assert worker_env({"OMP_NUM_THREADS": "4"}, ENV, 1)["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in worker_env({}, replace(ENV, nproc_per_node=1, nnodes=4), 0)


@pytest.mark.parametrize(
    ("plan", "code", "settle"),
    [
        ({}, 0, 1.0),  # every worker done
        ({"0/1": "exit:78"}, 78, 1.0),  # bad configuration
        # its own failure fails the pod: both ranks fail on their own, and the settle is long
        # enough that the judgement always sees both (it ends as soon as every rank has exited;
        # a short one raced the slower interpreter's start on a loaded machine: CI, session 10)
        ({"0/0": "sleep_then:1", "0/1": "sleep_then:76"}, 1, 120.0),
        ({"0/0": "exit:1", "0/1": "sleep"}, 1, 1.0),  # a crashed rank next to a healthy one
    ],
)
@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_exit_codes(tmp_path: Path, plan: dict[str, str], code: int, settle: float, fork: bool) -> None:
    assert supervisor(tmp_path, plan, settle=settle, fork_ranks=fork).run() == code


@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_a_worker_killed_by_a_signal_fails_the_pod_with_128_plus_signal(tmp_path: Path, fork: bool) -> None:
    sup = supervisor(tmp_path, {"0/0": "sleep", "0/1": "sleep"}, fork_ranks=fork)
    thread, result = run_in_thread(sup)
    wait_for(lambda: sup.group is not None and len(starts(tmp_path)) == 2)
    assert sup.group is not None
    sup.group.processes[1].kill()
    thread.join(LIVENESS)
    assert result == [128 + signal.SIGKILL]


@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_peer_loss_waits_for_the_next_attempt_and_restarts_in_place(tmp_path: Path, fork: bool) -> None:
    write_control(tmp_path, 0)
    plan = {"0/0": "exit:76", "0/1": "exit:76", "1/0": "sleep", "1/1": "sleep", "2/0": "exit:0",
            "2/1": "exit:0"}  # fmt: skip
    # Both ranks fail on their own; the settle ends as soon as both have exited (a short one
    # killed the slower interpreter before it ran on a loaded machine).
    sup = supervisor(tmp_path, plan, settle=LIVENESS, fork_ranks=fork)
    events: list[dict[str, object]] = []
    sup.emit = events.append
    thread, result = run_in_thread(sup)
    # The next attempt is written once the pod waits for it: written earlier, it replaced an
    # attempt whose workers had not started yet (CI, 2026-12-07: nothing of attempt 0 ran).
    wait_for(lambda: any(e["event"] == "peer_lost" for e in events))
    time.sleep(0.5)
    assert thread.is_alive(), "a pod whose ranks only lost a peer stays up"
    assert [r["attempt"] for r in starts(tmp_path)] == [0, 0]
    write_control(tmp_path, 1, resume="8", master="job-1-0.job.ns.svc")
    wait_for(lambda: len(starts(tmp_path)) == 4)
    # The attempt goes up again while the workers run: they are stopped and started anew.
    write_control(tmp_path, 2, resume="12", master="job-1-0.job.ns.svc")
    thread.join(LIVENESS)
    assert result == [0]
    runs = starts(tmp_path)
    assert [r["attempt"] for r in runs] == [0, 0, 1, 1, 2, 2]
    assert {(r["master"], r["resume"]) for r in runs[2:4]} == {("job-1-0.job.ns.svc", "8")}
    assert sorted(int(str(r["rank"])) for r in runs[4:]) == [2, 3]
    started = [e for e in events if e["event"] == "workers_started"]
    assert [e["forked"] for e in started] == [2 if fork else 0] * 3
    # forked: every attempt's ranks are children of the one forker, not of the supervisor
    assert len({r["parent"] for r in runs}) == 1 and (runs[0]["parent"] == os.getpid()) != fork


def test_peer_loss_gives_up_after_the_wait(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, {"0/0": "exit:76", "0/1": "exit:76"}, peer_wait=0.5, settle=LIVENESS)
    assert sup.run() == EXIT_PEER_LOST


@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_a_worker_ignoring_sigterm_is_killed_on_a_new_attempt(tmp_path: Path, fork: bool) -> None:
    write_control(tmp_path, 5)
    sup = supervisor(tmp_path, {"5/0": "ignore_term", "5/1": "sleep", "6/0": "exit:0", "6/1": "exit:0"},
                     fork_ranks=fork)  # fmt: skip
    thread, result = run_in_thread(sup)
    wait_for(lambda: sup.group is not None and len(starts(tmp_path)) == 2)
    assert sup.group is not None
    stubborn = sup.group.processes[0]
    write_control(tmp_path, 6)
    thread.join(LIVENESS)
    # killed after the 1 s grace (SIGKILL), not left to end its 60 s sleep on its own
    assert result == [0] and stubborn.returncode == -signal.SIGKILL


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and signals as on Linux")
@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_sigterm_is_forwarded_to_the_workers(tmp_path: Path, fork: bool) -> None:
    script = textwrap.dedent(f"""
        import json, os, sys
        sys.path[:0] = {[str(p) for p in sys.path if p]!r}
        from tests.unit.test_supervisor import supervisor
        from pathlib import Path
        sys.exit(supervisor(Path({str(tmp_path)!r}), {{"0/0": "sleep", "0/1": "sleep"}}, fork_ranks={fork}).run())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2],
                            start_new_session=True)  # fmt: skip
    wait_for(lambda: len(starts(tmp_path)) == 2)
    os.killpg(proc.pid, signal.SIGTERM)  # as a container stop signals the pod's process group
    assert proc.wait(LIVENESS) == 128 + signal.SIGTERM  # the workers died of the forwarded SIGTERM


def test_forked_ranks_fall_back_to_fresh_interpreters_when_the_forker_runs_threads(tmp_path: Path) -> None:
    """A fork copies only the calling thread: a forker running another thread refuses, and the
    ranks start as fresh interpreters (the pod trains either way)."""
    sup = supervisor(tmp_path, {}, fork_ranks=True, forker_thread=True)
    events: list[dict[str, object]] = []
    sup.emit = events.append
    assert sup.run() == 0
    assert [r["parent"] for r in starts(tmp_path)] == [os.getpid()] * 2
    assert [e["forked"] for e in events if e["event"] == "workers_started"] == [0]
    assert [e for e in events if e["event"] == "fork_failed"] == [{"event": "fork_failed", "forker_alive": True}]
    assert sup.forker is not None and sup.forker.process.poll() == 0, "the forker is let go at the end"


def test_warm_spares_take_the_next_attempt_in_place(tmp_path: Path) -> None:
    write_control(tmp_path, 0)
    plan = {"0/0": "sleep", "0/1": "sleep", "1/0": "sleep", "1/1": "sleep", "2/0": "exit:0", "2/1": "exit:0"}
    sup = supervisor(tmp_path, plan, warm_spares=True, spare_delay=0.0)
    thread, result = run_in_thread(sup)
    wait_for(lambda: len(starts(tmp_path)) == 2 and len(sup.spares) == 2)
    spare_pids = {s.pid for s in sup.spares}
    write_control(tmp_path, 1, resume="8", master="job-1-0.job.ns.svc")
    wait_for(lambda: len(starts(tmp_path)) == 4)
    second = starts(tmp_path)[2:]
    assert {r["pid"] for r in second} == spare_pids and all(r["warm"] for r in second)
    assert sorted(int(str(r["rank"])) for r in second) == [2, 3]
    assert {(r["master"], r["resume"]) for r in second} == {("job-1-0.job.ns.svc", "8")}
    # a spare that died meanwhile is replaced by a fresh process: the attempt still has every rank
    wait_for(lambda: len(sup.spares) == 2)
    sup.spares[0].kill()
    sup.spares[0].wait()
    left = sup.spares[1].pid
    write_control(tmp_path, 2)
    thread.join(LIVENESS)
    assert result == [0]
    third = starts(tmp_path)[4:]
    assert sorted(int(str(r["rank"])) for r in third) == [2, 3]
    assert [bool(r["warm"]) for r in sorted(third, key=lambda r: not r["warm"])] == [True, False]
    assert left in {r["pid"] for r in third}
    assert not sup.spares, "the supervisor lets its spares go when it exits"


def test_without_warm_spares_every_attempt_starts_new_processes(tmp_path: Path) -> None:
    write_control(tmp_path, 0)
    sup = supervisor(tmp_path, {"0/0": "sleep", "0/1": "sleep"}, spare_delay=0.0)
    thread, result = run_in_thread(sup)
    wait_for(lambda: len(starts(tmp_path)) == 2)
    time.sleep(0.3)
    assert not sup.spares
    write_control(tmp_path, 1)
    thread.join(LIVENESS)
    assert result == [0] and not any(r["warm"] for r in starts(tmp_path))


def test_spares_are_let_go_when_the_pod_finishes(tmp_path: Path) -> None:
    write_control(tmp_path, 0)
    sup = supervisor(tmp_path, {"0/0": "sleep_then:0", "0/1": "sleep_then:0"}, warm_spares=True,
                     spare_delay=0.0)  # fmt: skip
    assert sup.run() == 0
    assert len(starts(tmp_path)) == 2, "a spare never became a rank"


def reporting_supervisor(tmp_path: Path, plan: dict[str, str], reports: list[tuple[int, int]],
                         *, fail_report: bool = False, **kwargs: float | bool) -> Supervisor:
    def report(attempt: int, code: int) -> None:
        if fail_report:
            raise OSError("the checkpoint store did not answer")
        reports.append((attempt, code))

    sup = supervisor(tmp_path, plan, **kwargs)
    sup.report = report
    return sup


def test_an_own_crash_with_warm_spares_is_reported_and_the_spares_take_the_next_attempt(
    tmp_path: Path,
) -> None:
    write_control(tmp_path, 0)
    plan = {"0/0": "sleep_then:9", "0/1": "sleep", "1/0": "exit:0", "1/1": "exit:0"}
    reports: list[tuple[int, int]] = []
    sup = reporting_supervisor(tmp_path, plan, reports, warm_spares=True, spare_delay=60.0)
    thread, result = run_in_thread(sup)
    wait_for(lambda: reports == [(0, 9)])
    # The crash came before the spares were due: they are started now, for the next attempt.
    wait_for(lambda: len(sup.spares) == 2)
    time.sleep(0.5)
    assert thread.is_alive(), "the supervisor stays up once the operator knows"
    write_control(tmp_path, 1, resume="10")
    thread.join(LIVENESS)
    assert result == [0]
    # by attempt: the sleeping rank of attempt 0 may have been stopped before it logged its start
    second = [r for r in starts(tmp_path) if r["attempt"] == 1]
    assert len(second) == 2 and all(r["warm"] for r in second)


def test_an_own_crash_fails_the_pod_when_it_cannot_be_reported(tmp_path: Path) -> None:
    reports: list[tuple[int, int]] = []
    plan = {"0/0": "exit:9", "0/1": "exit:0"}
    assert reporting_supervisor(tmp_path, plan, reports, fail_report=True, warm_spares=True).run() == 9
    # without warm spares a report buys nothing (a fresh interpreter either way): the pod fails
    assert reporting_supervisor(tmp_path, plan, reports).run() == 9
    assert reports == []


def test_a_reported_crash_fails_the_pod_when_no_restart_comes(tmp_path: Path) -> None:
    reports: list[tuple[int, int]] = []
    sup = reporting_supervisor(tmp_path, {"0/0": "exit:9", "0/1": "exit:0"}, reports,
                               warm_spares=True, peer_wait=0.5)  # fmt: skip
    assert sup.run() == 9 and reports == [(0, 9)]


def test_a_bad_configuration_is_never_reported(tmp_path: Path) -> None:
    reports: list[tuple[int, int]] = []
    sup = reporting_supervisor(tmp_path, {"0/0": "exit:78", "0/1": "exit:0"}, reports, warm_spares=True)
    assert sup.run() == 78 and reports == []


def test_a_peer_loss_before_the_spares_were_due_starts_them_for_the_next_attempt(tmp_path: Path) -> None:
    write_control(tmp_path, 0)
    plan = {"0/0": "exit:76", "0/1": "exit:76", "1/0": "exit:0", "1/1": "exit:0"}
    sup = supervisor(tmp_path, plan, warm_spares=True, spare_delay=60.0, settle=LIVENESS)
    thread, result = run_in_thread(sup)
    wait_for(lambda: len(sup.spares) == 2)
    write_control(tmp_path, 1)
    thread.join(LIVENESS)
    second = [r for r in starts(tmp_path) if r["attempt"] == 1]
    assert result == [0] and len(second) == 2 and all(r["warm"] for r in second)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/comm")
def test_a_spare_takes_its_process_name_before_torch_loads() -> None:
    """Fault injectors and `ps` tell a waiting spare from a rank by its name; a spare still
    importing torch under its interpreter's name was taken for a rank (a SIGSTOPped spare then
    took the next attempt and hung it: bench/recovery.py --first-step --warm-spares)."""
    import ast

    main = Path(__file__).parents[2] / "trainer_image" / "topotrain_trainer" / "__main__.py"
    ours = [n.module for n in ast.parse(main.read_text()).body
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("topotrain_trainer")]  # fmt: skip
    assert ours[0] == "topotrain_trainer._procname", ours
    probe = ("import sys, topotrain_trainer._procname; "
             "print(open('/proc/self/comm').read().strip(), 'torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "TOPOTRAIN_WARM_SPARE": "1"},
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert out == ["topotrain-spare", "False"]
