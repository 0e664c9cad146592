"""A test session stopped by SIGTERM (a CI timeout, `kill`) runs its teardowns.

Before testbed.procs.sigterm_interrupts, Python's default SIGTERM ended pytest at once: a fixture's
teardown never ran, and a private testbed it had started (API server, etcd, KWOK, the operator)
kept running after the session. Here a real pytest session (its own process, the hook as
tests/conftest.py installs it) starts a child process in a fixture, is sent SIGTERM mid-test, and
the child must be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CONFTEST = """
from testbed.procs import sigterm_interrupts

def pytest_configure(config):
    sigterm_interrupts()
"""

TEST = """
import subprocess, sys, time
from pathlib import Path

import pytest

@pytest.fixture
def child(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path({pidfile!r}).write_text(str(proc.pid))
    yield proc
    proc.kill()
    proc.wait()
    Path({donefile!r}).write_text("torn down")

def test_waits(child):
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_runs_the_fixture_teardown(tmp_path: Path) -> None:
    pidfile, donefile = tmp_path / "child.pid", tmp_path / "done"
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_waits.py").write_text(TEST.format(pidfile=str(pidfile), donefile=str(donefile)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        deadline = time.monotonic() + 120  # a liveness bound: pytest's start, not a timing
        while not pidfile.exists() or not pidfile.read_text():
            assert session.poll() is None, session.communicate()[0]
            assert time.monotonic() < deadline, "the test's fixture never started its child"
            time.sleep(0.1)
        child = int(pidfile.read_text())
        assert _alive(child)
        session.send_signal(signal.SIGTERM)
        out, _ = session.communicate(timeout=120)
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
    assert donefile.exists(), out
    assert not _alive(child), out
    assert session.returncode != 0, out  # an interrupted session is not a pass
