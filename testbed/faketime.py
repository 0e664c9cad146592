"""libfaketime for the soak's skewed-clock replica (a test-boundary fake), from the cache.

Debian's package is downloaded once (`apt-get download`, no install) and unpacked under the
cache, keyed by the package's version, so a fresh machine gets it without changing the host.
A libfaketime installed on the host is used as it is. None when neither works (the soak then
records the clock-skew class as not injected).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from testbed.binaries import cache_dir

PACKAGE = "libfaketime"
INSIDE = Path("usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def library() -> Path | None:
    host = Path("/") / INSIDE
    if host.exists():
        return host
    cached = sorted((cache_dir() / "faketime").glob(f"*/{INSIDE}"))
    if cached:
        return cached[-1]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True, capture_output=True,
                           timeout=120)
            [deb] = Path(tmp).glob(f"{PACKAGE}_*.deb")
            version = deb.name.split("_")[1]
            target = cache_dir() / "faketime" / version
            target.mkdir(parents=True, exist_ok=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], check=True, capture_output=True,
                           timeout=60)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    found = target / INSIDE
    return found if found.exists() else None
