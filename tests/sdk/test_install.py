"""`topotrain-sdk` installs alone: a wheel built from sdk/ into a fresh virtual environment with
boto3 (and its own dependencies) only, no network. It imports, describes a local job and runs
its launcher with no kopf, Kubernetes client, pydantic, torch or topotrain importable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from topotrain_sdk.contract import CONTRACT_VERSION

ROOT = Path(__file__).resolve().parents[2]
# boto3 and what it imports: taken from this interpreter's site-packages, nothing else of it.
BOTO3 = ("boto3", "botocore", "s3transfer", "jmespath", "dateutil", "six.py", "urllib3")
ABSENT = ("kopf", "kubernetes", "pydantic", "torch", "topotrain", "topotrain_trainer", "yaml")

CHECK = f"""
import importlib.util, json, sys
import topotrain_sdk as tt
import topotrain_sdk.launch, topotrain_sdk.session, topotrain_sdk.folder, topotrain_sdk.checkpoints
import topotrain_sdk.mesh
from topotrain_sdk.checkpoints import CheckpointStore
present = [m for m in {ABSENT!r} if importlib.util.find_spec(m) is not None]
assert not present, present
assert "torch" not in sys.modules
job = tt.job()
print(json.dumps({{"file": tt.__file__, "rank": job.rank, "world": job.world_size,
                  "contract": job.contract_version,
                  "exits": [tt.EXIT_DONE, tt.EXIT_STOPPED, tt.EXIT_PEER_LOST, tt.EXIT_BAD_CONFIG],
                  "store": CheckpointStore("s3://b/p", "http://127.0.0.1:1").bucket}}))
"""


@pytest.mark.slow
def test_the_sdk_installs_and_runs_alone_in_a_fresh_venv(tmp_path: Path) -> None:
    source = shutil.copytree(ROOT / "sdk", tmp_path / "sdk",
                             ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                    str(tmp_path / "wheels"), str(source)], check=True, timeout=300)  # fmt: skip
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    wheel = next((tmp_path / "wheels").glob("topotrain_sdk-*.whl"))
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)  # fmt: skip
    deps = tmp_path / "boto3-only"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for name in BOTO3:
        (deps / name).symlink_to(site / name)
    target_site = next((venv / "lib").glob("python3*/site-packages"))
    (target_site / "boto3-only.pth").write_text(f"{deps}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    checked = subprocess.run([str(python), "-c", CHECK], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert str(target_site) in checked.stdout and '"world": 1' in checked.stdout
    assert f'"contract": {CONTRACT_VERSION}' in checked.stdout
    assert '"exits": [0, 75, 76, 78]' in checked.stdout and '"store": "b"' in checked.stdout
    # The console entry point: two workers with torchrun's ranks, outside any TrainingJob.
    launched = subprocess.run(
        [str(venv / "bin" / "topotrain-launch"), "--", str(python), "-c",
         "import os; os.write(1, f\"worker {os.environ['RANK']} {os.environ['WORLD_SIZE']}\\n\".encode())"],
        env={**env, "NPROC_PER_NODE": "2", "TOPOTRAIN_CONTROL_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert sorted(line for line in launched.stdout.splitlines() if line.startswith("worker")) == [
        "worker 0 2", "worker 1 2"]
