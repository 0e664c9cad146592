"""scripts/test.sh starts pytest while testbed/build.sh still builds (a cold machine); a test
looks a binary up only once the build has built it, and a failed or vanished build is an error
naming the binary, never a hang (testbed/binaries.py, wait_built). The build side (markers, .end)
is the real script: `testbed/build.sh` with TOPOTRAIN_BUILD_DONE set and nothing to build."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from testbed import binaries
from testbed.binaries import BUILD_PENDING_ENV, wait_built


def _pending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pid: int) -> Path:
    pending = tmp_path / "pending"
    pending.mkdir()
    (pending / ".pid").write_text(str(pid))
    monkeypatch.setenv(BUILD_PENDING_ENV, str(pending))
    return pending


def test_no_pending_build_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUILD_PENDING_ENV, raising=False)
    wait_built("kube-apiserver")


def test_waits_for_the_binarys_mark_not_for_the_whole_build(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pending = _pending(tmp_path, monkeypatch, os.getpid())
    marked = threading.Event()

    def build() -> None:
        time.sleep(0.5)
        (pending / "versitygw").touch()
        marked.set()

    threading.Thread(target=build, daemon=True).start()
    wait_built("versitygw")
    assert marked.is_set()
    assert not (pending / ".end").exists()  # the rest of the build still runs


def test_a_build_that_ended_lets_every_lookup_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pending = _pending(tmp_path, monkeypatch, os.getpid())
    (pending / ".end").write_text("0\n")
    wait_built("helm")  # ended: the binary is looked up (and reported missing) as without a build


def test_a_failed_build_names_the_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pending = _pending(tmp_path, monkeypatch, os.getpid())
    (pending / "versitygw").touch()
    (pending / ".end").write_text("2\n")
    wait_built("versitygw")  # built before the failure
    with pytest.raises(FileNotFoundError, match=r"failed \(exit 2\) before building kube-apiserver"):
        binaries.binary("kube-apiserver")


def test_a_build_that_died_without_a_word_is_an_error_not_a_hang(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _pending(tmp_path, monkeypatch, gone.pid)
    with pytest.raises(FileNotFoundError, match="is gone without building etcd"):
        wait_built("etcd")


def test_build_sh_marks_what_it_built_and_its_exit(tmp_path: Path) -> None:
    """The real script, with every binary already stamped (nothing to compile): the markers the
    waiters read. Skipped where the testbed was never built (it would compile for minutes)."""
    if not all((binaries.bin_dir() / name).exists() for name in ("versitygw", "etcd", "kubectl")):
        pytest.skip("the testbed binaries are not built here")
    done = tmp_path / "done"
    env = {**os.environ, "TOPOTRAIN_BUILD_DONE": str(done)}
    run = subprocess.run([str(binaries.BUILD_SCRIPT), "versitygw", "etcd"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert {p.name for p in done.iterdir()} == {"versitygw", "etcd", ".end"}
    assert (done / ".end").read_text().strip() == "0"
