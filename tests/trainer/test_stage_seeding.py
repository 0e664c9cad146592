"""Pipeline stages initialised on the meta device (models over 2B parameters) start from
different weights: each stage is seeded `seed + stage` on all of its ranks (parallel.seed_stage),
never from rank 0's generator state broadcast to the world. Three real gloo ranks, one stage
each, one layer each (so equal layer counts, the case a shared RNG state would make identical)."""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest
import torch

from .harness import REPO_ROOT, free_port

pytestmark = [pytest.mark.trainer]


def test_three_pipeline_stages_initialised_on_meta_have_different_weights(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", f"--master-port={free_port()}",
         str(Path(__file__).with_name("stage_seeds.py")), str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = [torch.load(tmp_path / f"stage-{s}.pt") for s in range(3)]
    assert [sorted({n.split(".")[1] for n in stage}) for stage in stages] == [["0"], ["1"], ["2"]]
    weights = [{n.split(".", 2)[2]: t for n, t in stage.items()} for stage in stages]
    for a, b in combinations(range(3), 2):
        for name, tensor in weights[a].items():
            if name.endswith("norm.weight"):
                continue  # ones everywhere
            assert not torch.equal(tensor, weights[b][name]), f"stages {a} and {b}: {name} equal"
    assert all(float(t.std()) > 0.005 for w in weights for n, t in w.items() if "norm" not in n)
