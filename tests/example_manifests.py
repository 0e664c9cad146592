"""The example TrainingJobs and the expectations written into the invalid ones.

Shared by the model-level tests (tests/unit/test_api.py) and the API-server
tests (tests/integration/test_crd.py), so both check the same manifests.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VALID = [*sorted((ROOT / "examples").glob("*.yaml")), ROOT / "examples" / "kueue" / "job.yaml",
         ROOT / "examples" / "templates" / "job.yaml", ROOT / "examples" / "multicluster" / "job.yaml"]
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))
# TrainingJobTemplates (cluster-scoped), and those each rule refuses.
VALID_TEMPLATES = [ROOT / "examples" / "templates" / "platform-h100.yaml"]
INVALID_TEMPLATES = sorted((ROOT / "examples" / "invalid" / "templates").glob("*.yaml"))


def expectation(path: Path, key: str) -> str:
    """The value of a `# key: value` comment (expect-field, expect-message)."""
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"{path.name} lacks '# {key}:'")
