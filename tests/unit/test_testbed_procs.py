"""The testbed's port choice: below the kernel's ephemeral range, so no outgoing connection's
source port can take a component's port between choosing and binding it (etcd once failed
to start with "address already in use" on a busy machine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testbed import procs
from testbed.procs import PORT_SPAN, ephemeral_range, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    low, _ = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert max(1024, low - PORT_SPAN) <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_reserved_port_is_never_handed_out_while_its_component_is_stopped(monkeypatch: Any) -> None:
    """The long soak (seed 3701): the API server's port, free while it restarted, was handed to a
    trainer's rendezvous store, and the API server could not bind it again."""
    low = ephemeral_range()[0]
    pair = [low - 2, low - 1]
    if not all(procs._bindable(p) for p in pair):
        pytest.skip(f"ports {pair} are in use on this machine")
    monkeypatch.setattr(procs, "PORT_SPAN", 2)
    monkeypatch.setattr(procs, "_RESERVED", set())
    procs.reserve(pair[0])
    assert {free_port() for _ in range(20)} == {pair[1]}


def test_a_port_another_process_testbed_claims_is_never_handed_out_until_that_testbed_is_gone(
        monkeypatch: Any, tmp_path: Path) -> None:
    """A warm CI run (2026-12-07): two pytest processes, each with a testbed of its own; the
    in-process reservation alone could not keep one process from handing out the port of the
    other's API server while a test restarted it. Here another process claims a port for its
    testbed's root; this one never picks it, cannot claim it, and takes it over once that root
    is gone."""
    low = ephemeral_range()[0]
    pair = [low - 2, low - 1]
    if not all(procs._bindable(p) for p in pair):
        pytest.skip(f"ports {pair} are in use on this machine")
    monkeypatch.setenv(procs.PORTS_DIR_ENV, str(tmp_path / "claims"))
    monkeypatch.setattr(procs, "PORT_SPAN", 2)
    monkeypatch.setattr(procs, "_RESERVED", set())
    theirs, mine = tmp_path / "their-testbed", tmp_path / "my-testbed"
    theirs.mkdir()
    mine.mkdir()
    other = subprocess.run(
        [sys.executable, "-c", f"from pathlib import Path; from testbed import procs; "
                               f"print(procs.claim({pair[0]}, Path({str(theirs)!r})))"],
        env={**os.environ, procs.PORTS_DIR_ENV: str(tmp_path / "claims")}, capture_output=True, text=True,
        check=True)
    assert other.stdout.strip() == "True", other
    assert {free_port() for _ in range(20)} == {pair[1]}
    assert not procs.claim(pair[0], mine)
    assert procs.claim(pair[1], mine)
    shutil.rmtree(theirs)  # their testbed is gone: the claim lapses
    assert procs.claim(pair[0], mine)
    assert not procs.claim(pair[0], theirs)  # now mine, against any other owner


def test_ephemeral_range_falls_back_to_linux_default(tmp_path: Path) -> None:
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    custom = tmp_path / "range"
    custom.write_text("40000\t50000\n")
    assert ephemeral_range(str(custom)) == (40000, 50000)


def test_killing_a_pods_group_reaches_a_child_that_moved_to_a_group_of_its_own() -> None:
    # What `tini -- python -m topotrain_trainer` does: the init's child gets its own group.
    import subprocess
    import sys
    import time

    from testbed.procs import group_alive, session_members, signal_group

    script = ("import os, subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)'])\n"
              "time.sleep(60)\n")  # fmt: skip
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 20
    while len(session_members(leader.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    members = session_members(leader.pid)
    assert len(members) == 2
    child = next(pid for pid in members if pid != leader.pid)
    signal_group(leader.pid, signal.SIGKILL)
    leader.wait()
    deadline = time.monotonic() + 20
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the child in its own group survived the pod's kill"
    assert not group_alive(leader.pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_pod_restarted_in_place_files_its_later_events_under_their_attempt(tmp_path: Path) -> None:
    """A kept pod's one log holds several attempts: the goodput benchmark read the restarted
    attempt's `restored` event as the old attempt's and reported its recovery as nan."""
    from testbed.harness_proc import events_by_attempt

    kept = tmp_path / "a0-job-0-0-abcd1234.log"
    kept.write_text("\n".join([
        '{"event": "workers_started", "attempt": 0, "source": "supervisor"}',
        '{"event": "step", "step": 1}',
        "not json: a warning from torch",
        '{"metric": "no event field"}',
        '{"event": "workers_started", "attempt": 1, "source": "supervisor"}',
        '{"event": "restored", "step": 0}',
    ]) + "\n")
    replaced = tmp_path / "a1-job-1-1-ef567890.log"
    replaced.write_text('{"event": "restored", "step": 0}\n')
    events = events_by_attempt([kept, replaced])
    assert [e["event"] for e in events[0]] == ["workers_started", "step"]
    assert [e["event"] for e in events[1]] == ["workers_started", "restored", "restored"]
