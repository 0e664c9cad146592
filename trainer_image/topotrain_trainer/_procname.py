"""The kernel's name of this process (/proc/self/comm): how `ps -o comm`, top and fault
injectors tell a waiting warm spare from a rank.

Imported by `__main__` before anything that imports torch: a spare names itself at once, so
it never looks like a rank while its imports run (seconds on a busy machine). Stdlib only.
"""

from __future__ import annotations

import os
import sys

from topotrain_sdk.supervisor import SPARE_ENV as SPARE_ENV  # stdlib only, like this module

SPARE_COMM = "topotrain-spare"  # a waiting spare's process name (/proc/PID/comm)


def set_process_name(name: str) -> None:
    """Set /proc/self/comm (15 bytes), on Linux."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_name = 15
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


if os.environ.get(SPARE_ENV) == "1":
    set_process_name(SPARE_COMM)
