"""The trainer's launcher in a real container: it may be PID 1's child (no init), and --help.

A rank whose launcher is the container's first process has parent PID 1 from the
start; it must not take that for "my launcher died" and exit (found on kind).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Liveness bounds (a passing run returns at once): CI runs the unit tests at nice 10 beside the
# kind stage, where an interpreter importing torch has taken tens of seconds.
LIVENESS = 300
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer_image"), str(REPO / "sdk")])}

ORPHAN = textwrap.dedent("""
    import os, sys, time
    me = os.getpid()
    if os.fork():
        os._exit(0)  # the parent goes: the child is re-parented (to PID 1 or a subreaper)
    deadline = time.time() + 10
    while os.getppid() == me and time.time() < deadline:
        time.sleep(0.01)
    from topotrain_trainer.__main__ import die_with_parent
    die_with_parent()
    open(sys.argv[1], "w").write(str(os.getppid()))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="prctl(PR_SET_PDEATHSIG) is Linux only")
def test_a_rank_whose_parent_already_is_the_init_process_keeps_running(tmp_path: Path) -> None:
    marker = tmp_path / "alive"
    subprocess.run([sys.executable, "-c", ORPHAN, str(marker)], env=ENV, timeout=LIVENESS, check=True)
    deadline = time.monotonic() + LIVENESS
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the rank exited although its (new) parent is alive"


def test_help_prints_usage_and_trains_nothing() -> None:
    done = subprocess.run([sys.executable, "-m", "topotrain_trainer", "--help"], env=ENV,
                          capture_output=True, text=True, timeout=LIVENESS)
    assert done.returncode == 0 and "usage: python -m topotrain_trainer" in done.stdout
    wrong = subprocess.run([sys.executable, "-m", "topotrain_trainer", "--steps", "3"], env=ENV,
                           capture_output=True, text=True, timeout=LIVENESS)
    assert wrong.returncode == 78 and "unknown arguments" in wrong.stderr


SUPERVISOR_IMPORTS = textwrap.dedent("""
    import json, sys
    from topotrain_trainer.__main__ import load
    from topotrain_trainer.supervisor import Supervisor  # noqa: F401
    env, config = load()  # what the pod's first process checks before it starts any rank
    print(json.dumps({"model": config.model, "torch": "torch" in sys.modules}))
""")


def test_the_pods_supervisor_validates_the_job_without_loading_torch(tmp_path: Path) -> None:
    """The pod's first process checks the configuration and supervises; only its ranks train.
    It imported torch (through the model table and the data module): about 4 CPU-seconds and
    a few hundred MB of memory in every pod, for nothing."""
    from topotrain.contract import CONTROL_DIR_ENV, TRAINING_CONFIG, TrainerEnv

    contract = TrainerEnv(master_addr="127.0.0.1", master_port=29500, nnodes=1, node_rank=0,
                          nproc_per_node=2, tensor=1, pipeline=1, data=2, job_name="j", job_namespace="n",
                          training_config='{"model": "small", "dataset": "synthetic"}')  # fmt: skip
    env = {k: v for k, v in ENV.items() if k not in ("LOCAL_RANK", "RANK")}
    env.update(contract.to_env())
    env[CONTROL_DIR_ENV] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", SUPERVISOR_IMPORTS], env=env, capture_output=True,
                          text=True, timeout=LIVENESS, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == '{"model": "small", "torch": false}'
    # and a bad model name is still refused there, naming the field
    env[TRAINING_CONFIG] = '{"model": "llama-70b"}'
    bad = subprocess.run([sys.executable, "-m", "topotrain_trainer"], env=env, capture_output=True,
                         text=True, timeout=LIVENESS, check=False)  # fmt: skip
    assert bad.returncode == 78 and "training.model='llama-70b'" in bad.stdout


def test_a_pipeline_stage_wrapping_the_transport_error_is_a_lost_peer() -> None:
    """torch's pipeline stage re-raises gloo's 'Connection reset by peer' as its own
    '[Stage 0] failed to run forward' (CI: the kept pod's rank exited 1, not 76, and an
    in-place restart became a recreate). A rank's own error stays its own."""
    from topotrain_trainer.__main__ import peer_lost

    def wrapped(inner: BaseException) -> RuntimeError:
        try:
            try:
                raise inner
            except RuntimeError as err:
                raise RuntimeError("\n[Stage 0] failed to run forward:\nargs: ...") from err
        except RuntimeError as outer:
            return outer

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2432: "
                        "Connection reset by peer. This is typically caused by a remote worker")
    assert peer_lost(wrapped(gloo))
    assert not peer_lost(wrapped(RuntimeError("mat1 and mat2 shapes cannot be multiplied")))
    assert not peer_lost(ValueError("bad batch"))
