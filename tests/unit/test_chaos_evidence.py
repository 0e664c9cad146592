"""The bounded soak's failure output: the logs of the jobs a failed invariant names (the CI
machine's workdir is gone by the time anyone reads the failure)."""

from __future__ import annotations

from pathlib import Path

from testbed.chaos.soak import SoakConfig, SoakResult, evidence
from testbed.chaos.timeline import Verdict


def _result(workdir: Path, verdicts: list[Verdict]) -> SoakResult:
    return SoakResult(SoakConfig(seed=1, faults=0, jobs=0), [], verdicts, {}, 1.0, 1.0, 1.0, workdir=workdir)


def test_the_named_jobs_logs_and_operator_lines_are_printed_and_no_others(tmp_path: Path) -> None:
    pods = tmp_path / "logs" / "chaos-ns"
    (pods / "elastic-0007").mkdir(parents=True)
    (pods / "dense-0006").mkdir(parents=True)
    (pods / "elastic-0007" / "a2-elastic-0007-2-1-5f470100.log").write_text(
        "".join(f"line {i}\n" for i in range(100)))  # fmt: skip
    (pods / "dense-0006" / "a0-dense-0006-0-0-c16f05ae.log").write_text("dense line\n")
    (tmp_path / "operator-0.log").write_text(
        "restart elastic-0007: startup timeout\nadmitted dense-0006\n")  # fmt: skip
    failed = Verdict("9 no restart without a fault", False, 3,
                     ("elastic-0007 attempt 4 at t=1796585133: no fault explains it",))  # fmt: skip
    text = evidence(_result(tmp_path, [failed, Verdict("1 held", True, 5)]), lines=10)
    assert "a2-elastic-0007-2-1-5f470100.log (last 10 lines)" in text
    assert "line 99" in text and "line 89" not in text
    assert "restart elastic-0007: startup timeout" in text
    assert "dense" not in text


def test_nothing_is_printed_when_every_invariant_held(tmp_path: Path) -> None:
    (tmp_path / "logs" / "ns" / "tiny-0001").mkdir(parents=True)
    (tmp_path / "logs" / "ns" / "tiny-0001" / "a0.log").write_text("x\n")
    assert evidence(_result(tmp_path, [Verdict("1 held", True, 5)])) == ""
