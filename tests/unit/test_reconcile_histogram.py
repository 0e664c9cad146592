"""The reconcile-pass histogram resolves the slow passes a 5,000-node run has.

bench/scale.py reads `topotrain_reconcile_seconds` from the operator's metrics endpoint
and reports its p99; with a top bucket of 5 s the p99 of a large run read only as
">5000". These tests render the operator's real registry and quantile it the way the
benchmark does.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from scale_probes import histogram_quantile
from topotrain.controller.metrics import Metrics


def buckets_of(metrics: Metrics) -> list[tuple[float, float]]:
    text = generate_latest(metrics.registry).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("topotrain_reconcile_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float(le), float(line.rsplit(" ", 1)[1])))
    return sorted(out)


def test_passes_of_tens_of_seconds_have_a_finite_p99() -> None:
    m = Metrics()
    for _ in range(97):
        m.reconcile.observe(0.07)
    for seconds in (12.0, 21.9, 25.0):
        m.reconcile.observe(seconds)
    p99 = histogram_quantile(0.99, buckets_of(m))
    assert 10 < p99 <= 30, p99
    assert histogram_quantile(0.5, buckets_of(m)) < 0.1


def test_a_pass_past_a_minute_still_reads_as_past_the_top_bucket() -> None:
    m = Metrics()
    m.reconcile.observe(0.07)
    m.reconcile.observe(90.0)
    assert histogram_quantile(0.99, buckets_of(m)) == float("inf")
