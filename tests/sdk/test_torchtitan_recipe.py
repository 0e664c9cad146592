"""The torchtitan recipe (recipes/torchtitan_train.py) on this machine's GPUs, where it has any.

torchtitan assumes an accelerator and is kept out of the CI environment, so this test runs only
where a CUDA GPU, torchtitan and a torchtitan source checkout (TORCHTITAN_CHECKOUT: its debug
model reads the checkout's tests/assets) are all present, and says which is missing elsewhere.
It runs the recipe under the launcher outside a TrainingJob, against the real S3 server: four
steps saved every two through the folder adapter (committed in the store), then a second run to
six steps that resumes from the newest committed step; with two or more GPUs tensor parallelism
is 2 under `tp-pp-dp`, so torchtitan's world mesh is the reordered one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from testbed.procs import free_port

if TYPE_CHECKING:
    from testbed.s3 import S3Server

torch = pytest.importorskip("torch")
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "torchtitan_train.py"
CHECKOUT = os.environ.get("TORCHTITAN_CHECKOUT", "")

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="torchtitan assumes an accelerator: no CUDA GPU on this machine"),
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (kept out of the CI environment: it assumes an accelerator)"),
    pytest.mark.skipif(not (Path(CHECKOUT) / "tests" / "assets").is_dir(),
                       reason="TORCHTITAN_CHECKOUT names no torchtitan source checkout (its tests/assets hold the "
                              "debug model's tokenizer and the c4_test sample)"),
]  # fmt: skip


@pytest.mark.s3
def test_torchtitan_checkpoints_through_the_folder_adapter_and_resumes(s3: S3Server, tmp_path: Path) -> None:
    from topotrain_sdk.checkpoints import CheckpointStore

    gpus = torch.cuda.device_count()
    tensor = 2 if gpus >= 2 and gpus % 2 == 0 else 1
    prefix = f"s3://{s3.create_bucket('titan')}/jobs/ns/titan"
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": s3.endpoint, "AWS_ACCESS_KEY_ID": s3.access_key,
           "AWS_SECRET_ACCESS_KEY": s3.secret_key, "TOPOTRAIN_CHECKPOINT_URI": prefix,
           "TOPOTRAIN_CHECKPOINT_INTERVAL": "2", "NPROC_PER_NODE": str(gpus), "TMPDIR": str(tmp_path),
           "TOPOTRAIN_CONTROL_DIR": str(tmp_path), "TOPOTRAIN_TP": str(tensor),
           "TOPOTRAIN_DP": str(gpus // tensor), "TOPOTRAIN_RANK_ORDER": "tp-pp-dp"}  # fmt: skip

    def run(steps: int) -> list[dict[str, object]]:
        command = [sys.executable, "-m", "topotrain_sdk.launch", "--", sys.executable, str(RECIPE),
                   "--module", "llama3", "--config", "llama3_debugmodel", f"--training.steps={steps}",
                   "--validator.enable=False"]  # fmt: skip
        done = subprocess.run(command, env={**env, "MASTER_PORT": str(free_port())}, cwd=CHECKOUT,
                              capture_output=True, text=True, timeout=540, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    store = CheckpointStore(prefix, s3.endpoint, s3.access_key, s3.secret_key)
    first = run(4)
    assert [c.step for c in store.list_committed()] == [2, 4]
    assert not [e for e in first if e.get("event") == "restored"]
    second = run(6)
    assert [e["step"] for e in second if e.get("event") == "restored"] == [4]
    assert [e["step"] for e in second if e.get("event") == "step"] == [5, 6]
    assert [c.step for c in store.list_committed()][-1] == 6
