"""The kernel's name of this process (/proc/self/comm): how `ps -o comm`, top and fault
injectors tell a waiting warm spare from a rank.

Imported by `__main__` before anything that imports torch: a spare names itself at once, so
it never looks like a rank while its imports run (seconds on a busy machine). Stdlib only.
"""

from __future__ import annotations

import os

# both stdlib only, like this module
from topotrain_sdk.forker import set_process_name as set_process_name
from topotrain_sdk.supervisor import SPARE_ENV as SPARE_ENV

SPARE_COMM = "topotrain-spare"  # a waiting spare's process name (/proc/PID/comm)

if os.environ.get(SPARE_ENV) == "1":
    set_process_name(SPARE_COMM)
