"""Shared fixtures: a cluster, a namespace per test, the S3 server, a bucket per test."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the `testbed` package lives at the repo root
    sys.path.insert(0, str(REPO_ROOT))
