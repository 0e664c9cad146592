"""bench/versus.py's quick form, seeded: topotrain and Kueue TAS + JobSet on one private
40-node testbed, 8 jobs each, a node loss under each.

The benchmark starts its own testbed (a temporary state directory, stopped at the end), so
this test neither uses nor disturbs the session's; it needs the testbed binaries, Kueue and
JobSet included. A few minutes on a quiet 2-core machine. It checks that both systems ran
the stream, that the placement phase placed instances, and that the report has every table,
not the figures.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

# `kueue`: the CI runs it in the final pass, once Kueue and JobSet are built.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.kueue,
    pytest.mark.timeout(900),
]

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def versus() -> Iterator[ModuleType]:
    from testbed.binaries import BUILD_SCRIPT, binary, kwok_stages
    from testbed.kueue import crd_dir

    # Built here when missing, as tests/conftest.py's `kueue` fixture does (seconds when
    # cached); this test starts its own testbed, so it does not use that fixture.
    subprocess.run([str(BUILD_SCRIPT), "kueue", "jobset"], check=False, stdout=subprocess.DEVNULL)
    try:
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
                     "kubectl", "kueue", "jobset"):  # fmt: skip
            binary(name)
        kwok_stages()
        crd_dir("kueue")
        crd_dir("jobset")
    except FileNotFoundError as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{err} (CI=true: not skipping)", pytrace=False)
        pytest.skip(str(err))
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location("bench_versus", BENCH / "versus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name.startswith(("bench_versus", "versus_", "scale_")):
                del sys.modules[name]


def test_quick_versus_runs_both_systems_and_prints_every_table(
    versus: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = versus.main(["--quick", "--seed", "1", "--yaml", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    for heading in ("| seed | job | pods asked |", "| summary | value |", "| job | pods asked |",
                    "| system | jobs Running |", "| system | node deleted |",
                    "| system | restart | job | pods | node deleted |",
                    "| can a user express |",
                    "| job | topotrain step s | Kueue TAS + JobSet step s | bound s | their step / ours |",
                    "| workload | jobs | Kueue TAS + JobSet / topotrain | worst |"):  # fmt: skip
        assert heading in out, out
    both = next(line for line in out.splitlines() if "instances placed by both" in line)
    assert int(both.split("|")[2]) > 0, out
    # the recovery phase: topotrain, alone on a fleet with free nodes, runs again after losing a
    # node; restarting in place it creates only the lost node's pod, recreating it makes them all
    rec = out.split("| system | restart | job | pods | node deleted |", 1)[1].split("\n\n", 1)[0]
    rows = {(c[1].strip(), c[2].strip()): c for c in (line.split("|") for line in rec.splitlines())
            if len(c) > 7}  # fmt: skip
    in_place, recreate = rows[("topotrain", "in place")], rows[("topotrain", "recreate")]
    assert float(in_place[6]) > 0 and int(in_place[7]) == 1, rec
    assert float(recreate[6]) > 0 and int(recreate[7]) == int(recreate[4]), rec
    assert ("Kueue TAS + JobSet", "BlockingRecreate") in rows, rec
    stream = out.split("| system | jobs Running |", 1)[1]
    rows = [line for line in stream.splitlines() if line.startswith(("| topotrain |", "| Kueue"))]
    running = {cells[1].strip(): cells[2].strip() for cells in (r.split("|") for r in rows[:2])}
    for system, count in running.items():
        assert not count.startswith("0/"), f"{system} ran no job:\n{out}"
    assert {p.name for p in tmp_path.iterdir()} >= {"kueue-queues.yaml", "small-jobset.yaml",
                                                    "small-trainingjob.yaml"}  # fmt: skip
