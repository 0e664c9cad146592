"""The scale benchmark's quick form: bench/scale.py's `main` at 40 nodes and 6 jobs, seeded.

The benchmark always starts a private testbed of its own (a temporary state
directory, stopped at the end), so this test neither uses nor disturbs the
session's testbed; it needs the testbed binaries. About a minute on a quiet
2-core machine: control plane, 40 KWOK nodes, the operator, six jobs (one an
8-pod gang), and a small planner measurement.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
QUICK = ["--nodes", "40", "--jobs", "6", "--interval", "0.5", "--seed", "3", "--settle", "10",
         "--timeout", "180", "--plan-nodes", "256", "--plan-pods", "32", "--plan-repeats", "2",
         "--plan-used", "0.5"]  # fmt: skip


@pytest.fixture
def scale() -> Iterator[ModuleType]:
    """bench/scale.py as a module; sys.path and the bench's modules are put back afterwards."""
    from testbed.binaries import binary, kwok_stages

    try:
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
                     "versitygw"):
            binary(name)
        kwok_stages()
    except FileNotFoundError as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{err} (CI=true: not skipping)", pytrace=False)
        pytest.skip(str(err))
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH / "scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name.startswith(("bench_scale", "scale_", "placement")):
                del sys.modules[name]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_quick_scale_run_every_job_runs_or_says_why(scale: ModuleType,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc = scale.main(QUICK)
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| nodes |"))
    assert _cells(lines[header]) == list(scale.COLUMNS)
    row = dict(zip(scale.COLUMNS, _cells(lines[header + 2]), strict=True))
    assert (row["nodes"], row["jobs"]) == ("40", "6")
    waiting = [line for line in lines if line.startswith("not Running at 40 nodes")]
    assert int(row["Running"]) + len(waiting) == 6, out
    assert "NO CONDITION SAYS WHY" not in out, out
    assert rc == 0, out
    assert int(row["Running"]) >= 1, out
    assert row["p50 s"] != "-" and float(row["p50 s"]) > 0
    assert row["passes"] != "-" and float(row["passes"]) >= 6  # at least a pass per job
    assert float(row["operator CPU s"]) > 0 and float(row["operator peak RSS MiB"]) > 0
    assert float(row["API requests/job"]) > 0
    assert float(row["events/s"]) > 0
    assert row["healthz misses"] == "0", out  # /healthz answered within the chart's liveness timeout
    plan = next(line for line in lines if line.startswith("| 256 |"))
    assert "infeasible" not in plan and _cells(plan)[-1] == "yes", out
