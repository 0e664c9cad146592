"""The bounded chaos soak: 60 faults covering every class, overlapping, on
three concurrent jobs and two peered operator replicas, on a private testbed
(its own control plane and S3, so restarting its API server disturbs no
other test). The pods' processes are
run by the pod process harness (a stand-in for a kubelet's process execution,
not a kubelet) and the trainer is the stand-in trainer (testbed/standin.py),
which speaks the real trainer's contract. Fails on any invariant violation;
the seed in the output replays the same schedule:

    python bench/chaos.py --faults 60 --jobs 3 --replicas 2 --gap 2.5 --calm 8 \
        --steps 60-100 --seed <seed>
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testbed.binaries import binary
from testbed.chaos.catalogue import CLASSIC
from testbed.chaos.soak import SoakConfig, evidence, run_soak, summary

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.slow]
# 119: its 60 faults cover all 17 classes in about three minutes (any seed replays its own).
# The classes issue 37 added are left to bench/chaos.py: drawing them changes the schedule.
SEED = int(os.environ.get("TOPOTRAIN_CHAOS_SEED", "119"))


def test_sixty_overlapping_faults_break_no_invariant(tmp_path: Path) -> None:
    try:
        for name in ("kube-apiserver", "etcd", "kwok", "versitygw"):
            binary(name)
    except FileNotFoundError as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{err} (CI=true: not skipping)", pytrace=False)
        pytest.skip(str(err))
    config = SoakConfig(seed=SEED, faults=60, jobs=3, mean_gap=2.5, steps=(60, 100), replicas=2,
                        calm=8.0, drain_seconds=300, kinds=set(CLASSIC))  # fmt: skip
    result = run_soak(config, tmp_path / "soak")
    print(summary(result))
    failed = [v.line() for v in result.verdicts if not v.ok]
    if failed:  # the workdir is gone with the CI machine: the output keeps what explains it
        print(evidence(result))
    assert not failed, f"seed {SEED}: invariant violations\n" + "\n".join(failed)
