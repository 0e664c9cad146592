"""`up` twice is harmless and `down` leaves no process behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cluster import Testbed
from testbed.kube import Kube

pytestmark = pytest.mark.integration


def test_up_again_keeps_the_running_processes(kube: Kube) -> None:
    bed = kube.require_testbed("the local launcher")
    before = {row.name: row.pid for row in bed.status()}

    bed.up()

    assert {row.name: row.pid for row in bed.status()} == before
    assert all(before.values())


def _state(pid: int) -> str | None:
    """The process state letter, None when the pid is gone (a zombie holds no resources)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() or [None])[0]
    except OSError:
        return None


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


@pytest.mark.slow
def test_down_leaves_no_process_behind(kube: Kube, tmp_path: Path) -> None:
    kube.require_testbed("the local launcher")  # binaries are known to exist
    bed = Testbed(tmp_path / "testbed")
    try:
        bed.up()
        pids = [row.pid for row in bed.status() if row.pid]
    finally:
        stopped = bed.down()
    assert len(pids) == 6

    assert sorted(stopped) == sorted(row.name for row in bed.status())
    assert all(row.pid is None for row in bed.status())
    for pid in pids:
        assert not _group_members(pid), f"process group {pid} still has members"
        assert _state(pid) in (None, "Z"), f"process {pid} still runs"
