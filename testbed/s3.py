"""An S3-compatible server for tests and the demo: versitygw with its posix
backend (Apache-2.0), keeping every bucket as a directory under `data_dir`.

    server = S3Server(tmp / "s3")
    server.start()                     # waits until it answers S3 requests
    server.create_bucket("ckpt")
    server.client().put_object(Bucket="ckpt", Key="a", Body=b"x")
    server.stop(); server.start()      # same port, same objects

The pid, port and log live next to the data in `run_dir` (default
`<data_dir>.run`), so another process can find and stop a running server.
"""

from __future__ import annotations

import contextlib
import http.client
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.binaries import binary
from testbed.procs import ManagedProcess, free_port, reserve, wait_until

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

DEFAULT_ACCESS_KEY = "topotrain"
DEFAULT_SECRET_KEY = "topotrain-testbed-secret"
REGION = "us-east-1"


class S3Server:
    """A versitygw process serving `data_dir` on a fixed loopback port."""

    def __init__(
        self,
        data_dir: Path | str,
        port: int | None = None,
        access_key: str = DEFAULT_ACCESS_KEY,
        secret_key: str = DEFAULT_SECRET_KEY,
        run_dir: Path | str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.run_dir = (
            Path(run_dir) if run_dir else self.data_dir.with_name(self.data_dir.name + ".run")
        )
        self.access_key = access_key
        self.secret_key = secret_key
        self._process = ManagedProcess("versitygw", self.run_dir)
        self._port_file = self.run_dir / "versitygw.port"
        self.port = port if port is not None else self._remembered_port()
        reserve(self.port, owner=self.run_dir)  # a restart binds it again, in any process

    def _remembered_port(self) -> int:
        """The port a previous start used (so restarts keep the endpoint), else a free one."""
        with contextlib.suppress(OSError, ValueError):
            return int(self._port_file.read_text())
        return free_port()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self._process.log_file

    def running(self) -> bool:
        return self._process.running()

    def start(self, timeout: float = 30.0) -> S3Server:
        """Start the server (a no-op if it already runs) and wait until it serves requests."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._port_file.write_text(f"{self.port}\n")
        argv = [
            str(binary("versitygw")),
            "--access", self.access_key,
            "--secret", self.secret_key,
            "--region", REGION,
            "--port", f"127.0.0.1:{self.port}",
            "posix", str(self.data_dir),
        ]  # fmt: skip
        self._process.start(argv)
        try:
            wait_until(self._answers, timeout=timeout, what=f"versitygw on {self.endpoint}")
        except TimeoutError as err:
            raise TimeoutError(f"{err}; log {self.log_file}:\n{self._process.tail()}") from None
        return self

    def _answers(self) -> bool:
        if not self._process.running():
            raise RuntimeError(f"versitygw exited; log {self.log_file}:\n{self._process.tail()}")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/")
            conn.getresponse().read()  # any HTTP answer (403 for anonymous) means it serves
            return True
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self) -> bool:
        """Stop the server; the data stays. True if it was running."""
        return self._process.stop()

    def restart(self) -> S3Server:
        self.stop()
        return self.start()

    def client(self) -> S3Client:
        """A boto3 S3 client for this server (path-style addressing)."""
        import boto3
        from botocore.config import Config

        client: S3Client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}),
        )
        return client

    def create_bucket(self, name: str) -> str:
        """Create `name` unless it exists; returns the name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        return name

    def env(self) -> dict[str, str]:
        """The environment variables an S3 client (boto3, the trainer) reads."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()
