"""Shared fixtures: a cluster (`kube`), a namespace per test, the S3 server
(`s3`) and a bucket per test (`s3_bucket`).

`kube` is the local testbed when KUBECONFIG is unset (started once per
session unless it already runs, stopped at the end only if this session
started it), otherwise the cluster KUBECONFIG names (kind, for example), so
the same suites run on both. With CI=true a missing cluster or S3 binary is
an error, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the `testbed` package lives at the repo root
    sys.path.insert(0, str(REPO_ROOT))
# The trainer SDK (sdk/topotrain_sdk, imported by the operator and the trainer) for shells whose
# PYTHONPATH predates it (scripts/test.sh and the Makefile set it); subprocesses inherit it too.
_SDK = str(REPO_ROOT / "sdk")
if _SDK not in sys.path:
    sys.path.insert(0, _SDK)
if _SDK not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SDK, os.environ.get("PYTHONPATH")]))

from testbed.kube import Kube  # noqa: E402

if TYPE_CHECKING:
    from testbed.kueue import KueueStack
    from testbed.s3 import S3Server

TESTBED_TOPOLOGY = REPO_ROOT / "examples" / "clusters" / "tiny.yaml"


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a CI timeout, `kill`) stops the session like Ctrl-C: teardowns run and stop
    the processes the tests started (testbed.procs.sigterm_interrupts)."""
    from testbed.procs import sigterm_interrupts

    sigterm_interrupts()


def _unavailable(reason: str) -> None:
    """Skip locally; fail (an ERROR in the fixture) under CI, where skipping would hide it."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: not skipping)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def kueue(kube: Kube) -> Iterator[KueueStack]:
    """Kueue (TAS on) and JobSet beside the shared testbed (testbed/kueue.py), for the session:
    started before any test's operator, which serves the Workload watch only when Kueue's
    CRDs exist as it starts. Tests that use it are marked `kueue`."""
    from testbed.binaries import BUILD_SCRIPT
    from testbed.kueue import KueueStack

    testbed = kube.require_testbed("Kueue and JobSet run as local processes beside it")
    # Built here when missing (minutes on a cold machine; seconds when cached): `make test`
    # builds them in the background before its kueue-marked pass, a test run by name does not.
    subprocess.run([str(BUILD_SCRIPT), "kueue", "jobset"], check=False, stdout=subprocess.DEVNULL)
    session = KueueStack(testbed, jobset=True).session()
    try:
        running = session.__enter__()
    except FileNotFoundError as err:
        _unavailable(f"Kueue or JobSet not built (`testbed/build.sh kueue jobset`): {err}")
        raise
    try:
        yield running
    finally:
        session.__exit__(None, None, None)


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    from testbed.client import api_client

    given = os.environ.get("KUBECONFIG")
    if given:
        with api_client(given.split(os.pathsep)[0]) as api:
            yield Kube(Path(given), api, testbed=None)
        return
    from testbed.cluster import Testbed

    bed = Testbed()
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(bed.session(topology=TESTBED_TOPOLOGY))
        except FileNotFoundError as err:
            _unavailable(f"no testbed binaries: {err}")
        api = stack.enter_context(api_client(bed.kubeconfig))
        yield Kube(bed.kubeconfig, api, testbed=bed)


def _dns_name(text: str, limit: int) -> str:
    """`text` shortened to a DNS-1123 label with a random suffix."""
    stem = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[: limit - 7].rstrip("-")
    return f"{stem}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = _dns_name(f"t-{request.node.name}", 50)
    kube.core.create_namespace({"metadata": {"name": name, "labels": {"topotrain.io/test": "1"}}})
    # Pods are admitted only once the controller manager created the default ServiceAccount.
    deadline = time.monotonic() + 60
    while not kube.core.list_namespaced_service_account(
        name, field_selector="metadata.name=default"
    ).items:
        if time.monotonic() > deadline:
            pytest.fail(f"no default ServiceAccount in {name}: is kube-controller-manager running?")
        time.sleep(0.2)
    yield name
    kube.delete_namespace(name)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """An S3 server (versitygw, posix backend) private to this session."""
    from testbed.s3 import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3") / "data")
    try:
        server.start()
    except FileNotFoundError as err:
        _unavailable(f"no S3 server binary: {err}")
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3: S3Server, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty bucket; emptied and deleted after the test."""
    name = s3.create_bucket(_dns_name(f"t-{request.node.name}", 40))
    yield name
    client = s3.client()
    # An operator or trainer of the test may still write a last object while this runs (a
    # fixture may be torn down before the operator's): empty and retry, a few times.
    for attempt in range(5):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=obj["Key"])
        try:
            client.delete_bucket(Bucket=name)
            return
        except client.exceptions.ClientError as exc:
            if "BucketNotEmpty" not in str(exc) or attempt == 4:
                raise
            time.sleep(1)
