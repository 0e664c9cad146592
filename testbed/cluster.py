"""The testbed launcher: a real Kubernetes control plane (etcd,
kube-apiserver, kube-controller-manager, kube-scheduler), KWOK playing the
kubelets of simulated GPU nodes, and an S3 server, all as local processes.

Every process is detached and tracked by a pid file under the state
directory, so `up` and `down` may run from different commands. `up` starts
only what is not running; `down` stops every process group it started.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from testbed import components
from testbed.binaries import REPO_ROOT
from testbed.components import DEFAULT_NODE_LEASE_SECONDS, Layout, Ports, Settings
from testbed.pki import ADMIN, CONTROLLER_MANAGER, KWOK, SCHEDULER, ClientIdentity, ensure_pki
from testbed.procs import ManagedProcess, claim, file_lock, free_port, reserve, wait_until
from testbed.s3 import S3Server

DEFAULT_BUCKET = "topotrain"
STATE_DIR_ENV = "TOPOTRAIN_TESTBED_DIR"

ArgvBuilder = Callable[[Layout, Settings], list[str]]
# Start order; `down` stops in reverse.
CONTROL_PLANE: tuple[tuple[str, ArgvBuilder], ...] = (
    ("etcd", components.etcd),
    ("kube-apiserver", components.apiserver),
    ("kube-controller-manager", components.controller_manager),
    ("kube-scheduler", components.scheduler),
    ("kwok", components.kwok),
)


def default_state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, REPO_ROOT / ".testbed")).resolve()


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int | None
    endpoint: str
    log: Path


class Testbed:
    """One testbed rooted at `state_dir` (default `.testbed/` or $TOPOTRAIN_TESTBED_DIR)."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        state_dir: Path | str | None = None,
        node_lease_seconds: int = DEFAULT_NODE_LEASE_SECONDS,
    ) -> None:
        """`node_lease_seconds` (lease duration = node-monitor grace) applies to a new testbed."""
        self._node_lease_seconds = node_lease_seconds
        self.layout = Layout(Path(state_dir).resolve() if state_dir else default_state_dir())
        self.root = self.layout.root
        self._state_file = self.root / "state.json"

    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    @property
    def s3(self) -> S3Server:
        return S3Server(self.layout.s3_data, run_dir=self.root)

    def process(self, name: str) -> ManagedProcess:
        return ManagedProcess(name, self.root)

    def settings(self) -> Settings:
        """Ports and node timing, chosen on first use and kept across restarts."""
        try:
            saved = json.loads(self._state_file.read_text())
            ports = Ports(**saved["ports"])
            reserve(*asdict(ports).values(), owner=self.root)  # a restart binds them again
            return Settings(ports, saved["nodeLeaseSeconds"])
        except (OSError, KeyError, TypeError, ValueError):
            pass
        self.root.mkdir(parents=True, exist_ok=True)
        chosen: set[int] = set()
        while len(chosen) < len(Ports.__dataclass_fields__):
            port = free_port()
            if claim(port, self.root):  # another process's testbed may have picked it meanwhile
                chosen.add(port)
        reserve(*chosen, owner=self.root)
        settings = Settings(Ports(*sorted(chosen)), self._node_lease_seconds)
        state = {"ports": asdict(settings.ports), "nodeLeaseSeconds": settings.node_lease_seconds}
        self._state_file.write_text(json.dumps(state, indent=2) + "\n")
        return settings

    def ports(self) -> Ports:
        return self.settings().ports

    def is_up(self) -> bool:
        """All processes run and the API server answers /readyz."""
        return all(self.process(n).running() for n, _ in CONTROL_PLANE) and self._apiserver_ready()

    def up(
        self, topology: Path | str | dict[str, object] | None = None, timeout: float = 300.0
    ) -> None:
        """Start whatever is not running, then apply `topology` (if given) and wait for its nodes."""
        settings = self.settings()
        ensure_pki(self.layout.pki)
        self._write_kubeconfigs(settings.ports)
        for name, argv in CONTROL_PLANE:
            self.process(name).start(argv(self.layout, settings))
            self._wait_component(name, settings.ports, timeout)
        self.s3.start()
        self.s3.create_bucket(DEFAULT_BUCKET)
        self._write_s3_env()
        if topology is not None:
            from testbed.nodes import apply_topology, wait_nodes_ready

            names = apply_topology(self.kubeconfig, topology)
            wait_nodes_ready(self.kubeconfig, names, timeout=timeout)

    def start_again(self, name: str, timeout: float = 180.0) -> None:
        """Start the stopped component `name` (of CONTROL_PLANE) again and wait until the testbed is
        up; started again while it exits at once (its port briefly held by a process outside the
        testbed's claims: testbed.procs.claim). Raises TimeoutError with the component's log."""
        argv = dict(CONTROL_PLANE)[name]
        process = self.process(name)
        deadline = time.monotonic() + timeout
        starts = 0
        while True:
            process.start(argv(self.layout, self.settings()))
            starts += 1
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: self.is_up() or not process.running(),
                           timeout=max(1.0, deadline - time.monotonic()), what=f"{name} after its restart")
            if self.is_up():
                return
            if time.monotonic() > deadline:
                down = [n for n, _ in CONTROL_PLANE if not self.process(n).running()]
                raise TimeoutError(
                    f"the testbed was not up {timeout:.0f}s after {name} was started again ({starts} starts; "
                    f"not running: {down or 'none'}); log {process.log_file}:\n{process.tail(30)}")
            time.sleep(2.0)

    def adopt(self) -> None:
        """Take the testbed over from test sessions: they will no longer stop it at their end."""
        (self.root / "started-by-session").unlink(missing_ok=True)

    def down(self) -> list[str]:
        """Stop every process; returns the names of those that were running. Data stays."""
        stopped = [n for n, _ in reversed(CONTROL_PLANE) if self.process(n).stop()]
        if self.s3.stop():
            stopped.append("versitygw")
        (self.root / "started-by-session").unlink(missing_ok=True)
        return stopped

    def status(self) -> list[ComponentStatus]:
        ports = self.ports()
        endpoints = {
            "etcd": f"http://127.0.0.1:{ports.etcd_client}",
            "kube-apiserver": f"https://127.0.0.1:{ports.apiserver}",
            "kube-controller-manager": f"https://127.0.0.1:{ports.controller_manager}",
            "kube-scheduler": f"https://127.0.0.1:{ports.scheduler}",
            "kwok": f"http://127.0.0.1:{ports.kwok}",
        }
        rows = [
            ComponentStatus(n, self.process(n).pid(), endpoints[n], self.process(n).log_file)
            for n, _ in CONTROL_PLANE
        ]
        s3 = self.s3
        s3_pid = ManagedProcess("versitygw", self.root).pid()
        rows.append(ComponentStatus("versitygw", s3_pid, s3.endpoint, s3.log_file))
        return rows

    # --- shared use by several test sessions ----------------------------

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """Serialise `up`/`down` decisions of concurrent test sessions on this state dir."""
        return file_lock(self.root)

    @contextlib.contextmanager
    def session(
        self, topology: Path | str | dict[str, object] | None = None, timeout: float = 300.0
    ) -> Iterator[Testbed]:
        """Use the testbed for one test session, starting it if needed.

        A testbed that someone started with `up` stays up. One that a session
        started is stopped by the last session (of any process) to finish.
        """
        users = self.root / "sessions"
        me = users / str(os.getpid())
        with self.locked():
            if not self.is_up():
                self.up(timeout=timeout)
                (self.root / "started-by-session").touch()
            users.mkdir(exist_ok=True)
            me.touch()
            if topology is not None:
                from testbed.nodes import apply_topology, wait_nodes_ready

                wait_nodes_ready(
                    self.kubeconfig, apply_topology(self.kubeconfig, topology), timeout
                )
        try:
            yield self
        finally:
            with self.locked():
                me.unlink(missing_ok=True)
                alive = [p for p in users.iterdir() if _pid_alive(int(p.name))]
                marker = self.root / "started-by-session"
                if not alive and marker.exists():
                    self.down()  # removes the marker too

    # --- readiness -------------------------------------------------------

    def _wait_component(self, name: str, ports: Ports, timeout: float) -> None:
        checks: dict[str, Callable[[], bool]] = {
            "etcd": lambda: _http_ok(f"http://127.0.0.1:{ports.etcd_client}/health"),
            "kube-apiserver": self._apiserver_ready,
            "kube-controller-manager": lambda: _https_ok(ports.controller_manager),
            "kube-scheduler": lambda: _https_ok(ports.scheduler),
            "kwok": lambda: _http_ok(f"http://127.0.0.1:{ports.kwok}/healthz"),
        }
        process = self.process(name)

        def ready() -> bool:
            if not process.running():
                raise RuntimeError(f"{name} exited; log {process.log_file}:\n{process.tail()}")
            return checks[name]()

        try:
            wait_until(ready, timeout=timeout, what=name, interval=0.3)
        except TimeoutError as err:
            raise TimeoutError(f"{err}; log {process.log_file}:\n{process.tail()}") from None

    def _apiserver_ready(self) -> bool:
        pki = self.layout.pki
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return _http_ok(f"https://127.0.0.1:{self.ports().apiserver}/readyz", context)

    # --- files -----------------------------------------------------------

    def _write_kubeconfigs(self, ports: Ports) -> None:
        server = f"https://127.0.0.1:{ports.apiserver}"
        _write_kubeconfig(self.kubeconfig, server, self.layout.pki, ADMIN)
        for identity in (CONTROLLER_MANAGER, SCHEDULER, KWOK):
            path = self.layout.component_kubeconfig(identity.stem)
            _write_kubeconfig(path, server, self.layout.pki, identity)

    def _write_s3_env(self) -> None:
        env = {**self.s3.env(), "TOPOTRAIN_TESTBED_BUCKET": DEFAULT_BUCKET}
        (self.root / "s3.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _write_kubeconfig(path: Path, server: str, pki: Path, identity: ClientIdentity) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "topotrain-testbed",
                "cluster": {"server": server, "certificate-authority-data": _b64(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": identity.user,
                "user": {
                    "client-certificate-data": _b64(pki / f"{identity.stem}.crt"),
                    "client-key-data": _b64(pki / f"{identity.stem}.key"),
                },
            }
        ],
        "contexts": [
            {
                "name": "topotrain-testbed",
                "context": {"cluster": "topotrain-testbed", "user": identity.user},
            }
        ],
        "current-context": "topotrain-testbed",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _https_ok(port: int) -> bool:
    """/healthz of a component serving a self-signed certificate (always-allowed path)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return _http_ok(f"https://127.0.0.1:{port}/healthz", context)
