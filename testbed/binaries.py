"""Where the testbed finds the binaries that `testbed/build.sh` builds."""

from __future__ import annotations

import os
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "testbed" / "build.sh"


def code_path() -> str:
    """PYTHONPATH holding this checkout's packages: what an image built from it would run.

    The cached venv is shared by every checkout on the machine and its editable
    install points at whichever checkout bootstrapped last, so processes we
    start (trainer pods, the operator) get this checkout's code explicitly."""
    return os.pathsep.join(str(REPO_ROOT / part) for part in ("operator", "trainer_image", "sdk"))


def cache_dir() -> Path:
    return Path(os.environ.get("TOPOTRAIN_CACHE", Path.home() / ".cache" / "topotrain"))


def bin_dir() -> Path:
    return cache_dir() / "bin"


# scripts/test.sh starts pytest while testbed/build.sh may still be building (a cold machine): it
# names a directory where the build marks each binary it has built (an empty file of that name),
# its own pid (.pid) and, when it ends, its exit status (.end). A binary is looked up only once it
# is marked or the build has ended; the trainer tests, which need only the S3 server (built first),
# then run while the Kubernetes binaries are still being compiled.
BUILD_PENDING_ENV = "TOPOTRAIN_BUILD_PENDING"


def _build_alive(pending: Path) -> bool:
    try:
        os.kill(int((pending / ".pid").read_text()), 0)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def wait_built(name: str) -> None:
    """Return once `name` is built or the build has ended (see BUILD_PENDING_ENV); at once when
    no build is pending. Raises FileNotFoundError when the build ended without building it or
    died without saying so."""
    pending_dir = os.environ.get(BUILD_PENDING_ENV)
    if not pending_dir:
        return
    pending = Path(pending_dir)
    while not (pending / name).exists():
        end = pending / ".end"
        if end.exists():
            status = end.read_text().strip()
            if status != "0":
                raise FileNotFoundError(f"testbed/build.sh failed (exit {status}) before building {name}")
            return
        if not _build_alive(pending) and not end.exists() and not (pending / name).exists():
            raise FileNotFoundError(f"testbed/build.sh is gone without building {name} ({pending})")
        time.sleep(1)


def binary(name: str) -> Path:
    """Path of a built testbed binary; raises FileNotFoundError saying how to build it."""
    wait_built(name)
    path = bin_dir() / name
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"{path} is missing: build the testbed binaries with `{BUILD_SCRIPT}` "
            "(or `make testbed-build`)"
        )
    return path


def versions() -> dict[str, str]:
    """The pinned versions from testbed/versions.env (KUBERNETES_VERSION, ...)."""
    pinned: dict[str, str] = {}
    for line in (REPO_ROOT / "testbed" / "versions.env").read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not name.startswith("#"):
            pinned[name.strip()] = value.strip()
    return pinned


# A pod with this label is never completed by KWOK's `pod-complete` stage, which otherwise
# moves every Running pod owned by a Job to Succeeded at once: a JobSet's pods (Kueue + JobSet
# in bench/versus.py) then stay Running and hold their GPUs as a training gang does.
KEEP_RUNNING_LABEL = "testbed.topotrain.io/keep-running"


def kwok_stages() -> Path:
    """KWOK's default and chaos stages, assembled by build.sh from the pinned module, with
    `pod-complete` skipping pods labelled KEEP_RUNNING_LABEL (a file derived next to it)."""
    wait_built("kwok")
    built = cache_dir() / "share" / f"kwok-stages-{versions()['KWOK_VERSION']}.yaml"
    if not built.exists():
        raise FileNotFoundError(f"{built} is missing: run `{BUILD_SCRIPT} kwok`")
    derived = built.with_name(built.stem + "-testbed.yaml")
    if not derived.exists() or derived.stat().st_mtime < built.stat().st_mtime:
        import yaml

        stages = list(yaml.safe_load_all(built.read_text()))
        for stage in stages:
            if stage["metadata"]["name"] == "pod-complete":
                stage["spec"]["selector"]["matchExpressions"].append(
                    {"key": f'.metadata.labels["{KEEP_RUNNING_LABEL}"]', "operator": "DoesNotExist"}
                )
        partial = derived.with_suffix(".tmp")
        partial.write_text(yaml.safe_dump_all(stages, sort_keys=False))
        partial.replace(derived)
    return derived
