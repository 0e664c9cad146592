"""The host's kernel settings (/proc/sys), for checking that a kind run leaves them as found.

kind nodes share the host's kernel; a kubelet, systemd or kube-proxy in a node
that could write /proc/sys would change the host's settings (kernel.panic,
vm.overcommit_memory, kernel.keys.*, ...). `snapshot()` reads every setting
that does not change by itself; `python tests/kind/host_sysctl.py save FILE`
and `... compare FILE` are used by scripts/kind-e2e.sh around a whole run.
Network settings are read in the host's namespace only where they are global
(net.core, net.ipv4/ipv6 top level, conf/all and conf/default, netfilter): the
interfaces of kind's own network come and go with it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path("/proc/sys")
# Counters and state that move by themselves on any busy machine.
VOLATILE = re.compile(
    r"^(kernel/random/|kernel/ns_last_pid$|kernel/pty/nr$|fs/(dentry-state|inode-nr|inode-state"
    r"|file-nr|aio-nr)$|fs/quota/|fs/binfmt_misc/|net/netfilter/nf_conntrack_count$"
    r"|net/ipv[46]/(conf|neigh)/(?!all/|default/)|net/ipv6/route/|net/ipv4/route/"
    r"|kernel/sched_domain/|kernel/usermodehelper/|vm/stat_refresh$|vm/drop_caches$"
    r"|vm/compact_memory$|net/ipv4/tcp_fastopen_key$)"
)


def snapshot(root: Path = ROOT) -> dict[str, str]:
    """Every readable, non-volatile setting under `root`, key -> value."""
    values: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if VOLATILE.match(key) or not path.is_file():
            continue
        try:
            values[key] = path.read_text().strip()
        except OSError:  # write-only entries, or ones that refuse to be read
            continue
    return values


def differences(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Human-readable lines, one per setting that changed, appeared or vanished."""
    lines = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old != new:
            lines.append(f"{key.replace('/', '.')}: {old!r} -> {new!r}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("save", "compare"):
        print("usage: host_sysctl.py save|compare FILE", file=sys.stderr)
        return 2
    path = Path(argv[2])
    if argv[1] == "save":
        path.write_text(json.dumps(snapshot(), indent=0, sort_keys=True))
        return 0
    changed = differences(json.loads(path.read_text()), snapshot())
    for line in changed:
        print(f"host kernel setting changed: {line}", file=sys.stderr)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
