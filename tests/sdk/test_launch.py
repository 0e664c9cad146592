"""`topotrain-launch -- <command>`: real launcher and worker processes on this machine (no
cluster; the control file the kubelet would write is written by the test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from testbed.procs import wait_until
from topotrain_sdk.contract import EXIT_BAD_CONFIG, EXIT_STOPPED, TrainerEnv, format_control
from topotrain_sdk.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
# A worker that records its environment, then exits as TOPOTRAIN_TEST_EXIT (JSON: attempt -> code)
# says, or waits for SIGTERM and exits 75 when the attempt is not listed.
WORKER = """
import json, os, signal, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TOPOTRAIN_ATTEMPT", "TOPOTRAIN_RESUME_STEP")
out = os.path.join(os.environ["OUT"], f"a{os.environ['TOPOTRAIN_ATTEMPT']}-r{os.environ['RANK']}")
with open(out + ".tmp", "w") as f:
    json.dump({**{k: os.environ.get(k) for k in keys}, "parent": os.getppid()}, f)
os.replace(out + ".tmp", out)  # whole, or not there yet
code = json.loads(os.environ["TOPOTRAIN_TEST_EXIT"]).get(os.environ["TOPOTRAIN_ATTEMPT"])
if code is not None:
    sys.exit(code)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
while True:
    time.sleep(0.1)
"""


def launch(tmp_path: Path, exits: dict[str, int], *options: str, **env: str) -> subprocess.Popen[str]:
    (tmp_path / "out").mkdir(exist_ok=True)
    full = {**os.environ, "TOPOTRAIN_CONTROL_DIR": str(tmp_path), "OUT": str(tmp_path / "out"),
            "TOPOTRAIN_TEST_EXIT": json.dumps(exits), "NNODES": "2", "NODE_RANK": "1",
            "NPROC_PER_NODE": "2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29600",
            "TOPOTRAIN_JOB_NAME": "j", **env}  # fmt: skip
    command = [sys.executable, "-c", WORKER]
    if options:  # --fork: a script, as `python train.py` (the forker runs scripts and modules)
        (tmp_path / "worker.py").write_text(WORKER)
        command = [sys.executable, str(tmp_path / "worker.py")]
    return subprocess.Popen([sys.executable, "-m", "topotrain_sdk.launch", *options, "--", *command],
                            env=full, text=True, stdout=subprocess.PIPE)  # fmt: skip


def seen(tmp_path: Path, attempt: int) -> dict[int, dict[str, str]]:
    files = sorted(f for f in (tmp_path / "out").glob(f"a{attempt}-r*") if f.suffix != ".tmp")
    return {int(f.name.split("-r")[1]): json.loads(f.read_text()) for f in files}


def test_each_worker_gets_torchruns_environment(tmp_path: Path) -> None:
    launcher = launch(tmp_path, {"0": 0})
    assert launcher.wait(timeout=120) == 0
    workers = seen(tmp_path, 0)
    assert sorted(workers) == [2, 3], "pod 1 of 2, two local ranks: global ranks 2 and 3"
    for rank, env in workers.items():
        assert env.pop("parent") == launcher.pid
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank - 2), "WORLD_SIZE": "4",
                       "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.7",
                       "MASTER_PORT": "29600", "TOPOTRAIN_ATTEMPT": "0", "TOPOTRAIN_RESUME_STEP": ""}


def test_a_new_attempt_restarts_the_workers_in_place_and_sigterm_reaches_them(tmp_path: Path) -> None:
    launcher = launch(tmp_path, {})
    wait_until(lambda: len(seen(tmp_path, 0)) == 2, timeout=60, what="attempt 0's workers")
    (tmp_path / "annotations").write_text(format_control({
        "topotrain.io/attempt": "1", "topotrain.io/resume-step": "8",
        "topotrain.io/master-addr": "10.0.0.9", "topotrain.io/master-port": "29700"}))
    wait_until(lambda: len(seen(tmp_path, 1)) == 2, timeout=60, what="attempt 1's workers")
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["TOPOTRAIN_RESUME_STEP"])
            for e in seen(tmp_path, 1).values()} == {("10.0.0.9", "29700", "8")}
    assert launcher.poll() is None, "the launcher (the pod) stays up across the restart"
    time.sleep(0.5)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == EXIT_STOPPED, "the workers' own exit code after SIGTERM"


def test_fork_forks_every_attempts_workers_from_one_preloaded_interpreter(tmp_path: Path) -> None:
    """`--fork`: the workers of both attempts are children of one forker (process name
    topotrain-fork) that imported the preload modules once, with torchrun's environment as
    before; SIGTERM reaches them; a command the forker cannot run is a configuration error."""
    launcher = launch(tmp_path, {}, "--fork=json,email")
    wait_until(lambda: len(seen(tmp_path, 0)) == 2, timeout=60, what="attempt 0's workers")
    forker = {w.pop("parent") for w in seen(tmp_path, 0).values()}
    assert len(forker) == 1 and forker != {launcher.pid}
    assert Path(f"/proc/{min(forker)}/comm").read_text().strip() == "topotrain-fork"
    (tmp_path / "annotations").write_text(format_control({"topotrain.io/attempt": "1"}))
    wait_until(lambda: len(seen(tmp_path, 1)) == 2, timeout=60, what="attempt 1's workers")
    workers = seen(tmp_path, 1)
    assert {w.pop("parent") for w in workers.values()} == forker
    assert {r: (w["RANK"], w["LOCAL_RANK"], w["TOPOTRAIN_ATTEMPT"]) for r, w in workers.items()} == {
        2: ("2", "0", "1"), 3: ("3", "1", "1")}
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == EXIT_STOPPED, "the workers' own exit code after SIGTERM"
    refused = subprocess.run([sys.executable, "-m", "topotrain_sdk.launch", "--fork", "--", "/bin/true"],
                             env={**os.environ, "TOPOTRAIN_CONTROL_DIR": str(tmp_path), "NPROC_PER_NODE": "1"},
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert refused.returncode == EXIT_BAD_CONFIG and "--fork needs" in refused.stdout


THREADS = """
import json, os, sys, torch
with open(os.environ["OUT"], "w") as f:
    json.dump({"threads": torch.get_num_threads(), "parent": os.getppid()}, f)
"""


def test_a_forked_worker_has_the_intra_op_threads_a_new_interpreter_would(tmp_path: Path) -> None:
    """The forker imports torch with one OpenMP thread (torch starts its pool at import, and a
    process running threads may not fork); a one-worker pod without OMP_NUM_THREADS still gets
    torch's default in its worker, one thread per CPU, and a pod that sets it gets its value."""
    (tmp_path / "threads.py").write_text(THREADS)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                           capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    for omp, want in ((None, int(fresh.stdout)), ("3", 3)):
        out = tmp_path / f"threads-{omp}"
        full = {**env, "TOPOTRAIN_CONTROL_DIR": str(tmp_path), "OUT": str(out), "NPROC_PER_NODE": "1",
                **({"OMP_NUM_THREADS": omp} if omp else {})}  # fmt: skip
        launcher = subprocess.Popen([sys.executable, "-m", "topotrain_sdk.launch", "--fork", "--", sys.executable,
                                     str(tmp_path / "threads.py")], env=full)  # fmt: skip
        assert launcher.wait(timeout=120) == 0
        seen_threads = json.loads(out.read_text())
        assert seen_threads["parent"] != launcher.pid, "the worker was forked, not started anew"
        assert seen_threads["threads"] == want, (omp, seen_threads)


def test_a_workers_failure_fails_the_pod_without_a_store_to_report_to(tmp_path: Path) -> None:
    assert launch(tmp_path, {"0": 3}).wait(timeout=120) == 3


def test_a_broken_contract_or_no_command_is_a_configuration_error(tmp_path: Path) -> None:
    assert launch(tmp_path, {"0": 0}, NODE_RANK="2").wait(timeout=60) == EXIT_BAD_CONFIG
    bare = subprocess.run([sys.executable, "-m", "topotrain_sdk.launch"], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert bare.returncode == EXIT_BAD_CONFIG and "usage: topotrain-launch" in bare.stderr


def test_a_reported_failure_keeps_the_pod_for_an_in_place_restart(tmp_path: Path) -> None:
    """The launcher's supervisor with a fake reporter (a unit-test boundary for the checkpoint
    store's failure.json; tests/e2e/test_byo_trainer.py writes the real one): the pod stays up
    after its worker failed, and the operator's next attempt starts fresh workers."""
    reported: list[tuple[int, int]] = []
    (tmp_path / "out").mkdir()
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TOPOTRAIN_TEST_EXIT": '{"0": 3, "1": 0}'}
    pod = TrainerEnv("127.0.0.1", 29500, 1, 0, 1, 1, 1, 1, job_name="j")
    supervisor = Supervisor(pod, tmp_path / "annotations", worker_argv=[sys.executable, "-c", WORKER],
                            base_env=env, poll=0.05, settle=0.2, peer_wait=60, emit=lambda _: None,
                            report=lambda attempt, code: reported.append((attempt, code)),
                            keep_pod_on_failure=True)  # fmt: skip
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    wait_until(lambda: reported == [(0, 3)], timeout=60, what="the failure reported")
    assert thread.is_alive(), "the pod is kept"
    (tmp_path / "annotations").write_text(format_control({"topotrain.io/attempt": "1"}))
    thread.join(timeout=60)
    assert result == [0] and sorted(seen(tmp_path, 1)) == [0]
