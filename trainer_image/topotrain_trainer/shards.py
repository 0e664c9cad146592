"""Where a tokenized dataset lives, and the streaming reader of its samples.

A dataset (written by `prepare`, see data.py) is an `index.json` and token shards under one
location: a directory, or an S3 prefix (`s3://bucket/prefix`, read with the pod's AWS_*
environment, the checkpoint store's credentials). `open_store` picks the kind by the URI.

`ShardReader` fetches exactly the byte range of each sample it is asked for: ranged GETs
(or preads) run in parallel on a small pool, a bounded LRU cache keeps recently read samples,
and nothing is downloaded ahead of the samples a rank trains on. Prefetching ahead of the step
is the batch loader's thread (data.py), which asks for the next steps' samples early.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MiB = 1 << 20


class DatasetStore(Protocol):
    uri: str

    def read(self, name: str) -> bytes: ...

    def read_range(self, name: str, start: int, length: int) -> bytes: ...

    def write(self, name: str, data: bytes) -> None: ...


class DirStore:
    """A dataset in a local (or mounted) directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = str(root)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def _fd(self, name: str) -> int:
        with self._lock:
            if name not in self._fds:
                self._fds[name] = os.open(self.root / name, os.O_RDONLY)
            return self._fds[name]

    def read_range(self, name: str, start: int, length: int) -> bytes:
        data = os.pread(self._fd(name), length, start)
        if len(data) != length:
            raise OSError(f"{self.root / name}: short read at {start} ({len(data)} of {length})")
        return data

    def write(self, name: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.{os.getpid()}"
        tmp.write_bytes(data)
        tmp.replace(self.root / name)  # atomic: a reader never sees half a file

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class S3Store:
    """A dataset under an S3 prefix."""

    def __init__(self, uri: str, client: S3Client | None = None) -> None:
        from topotrain_sdk.records import split_uri
        from topotrain_sdk.s3client import make_client

        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = split_uri(self.uri)
        self.client = client or make_client()

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def read(self, name: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self.key(name))["Body"].read()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        got = self.client.get_object(
            Bucket=self.bucket, Key=self.key(name), Range=f"bytes={start}-{start + length - 1}"
        )
        data = got["Body"].read()
        if len(data) != length:
            raise OSError(f"{self.uri}/{name}: short read at {start} ({len(data)} of {length})")
        return data

    def write(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)


def open_store(uri: str, client: S3Client | None = None) -> DatasetStore:
    """The store a `training.dataset` value names: `s3://bucket/prefix` or a directory."""
    if uri.startswith("s3://"):
        return S3Store(uri, client)
    return DirStore(Path(uri))


def missing(err: BaseException) -> bool:
    """The error says the object (or its bucket) does not exist, as opposed to a store down."""
    if isinstance(err, FileNotFoundError):
        return True
    code = getattr(err, "response", {}).get("Error", {}).get("Code", "")
    return code in ("NoSuchKey", "NoSuchBucket", "404")


@dataclass
class ReadStats:
    """What a reader fetched (for the benchmark and the data-wait metrics)."""

    requests: int = 0
    bytes: int = 0
    cache_hits: int = 0
    seconds: float = 0.0  # wall time inside read_many


@dataclass(frozen=True)
class Extent:
    """Where one sample's tokens are: shard file, byte offset, byte length."""

    file: str
    start: int
    length: int


class ShardReader:
    """Reads sample extents from a store: parallel ranged reads and a bounded LRU cache."""

    def __init__(self, store: DatasetStore, *, workers: int = 8, cache_bytes: int = 64 * MiB) -> None:
        self.store, self.cache_bytes = store, cache_bytes
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="topotrain-read")
        self._cache: OrderedDict[Extent, bytes] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()
        self.stats = ReadStats()

    def _lookup(self, extent: Extent) -> bytes | None:
        with self._lock:
            data = self._cache.get(extent)
            if data is not None:
                self._cache.move_to_end(extent)
                self.stats.cache_hits += 1
            return data

    def _remember(self, extent: Extent, data: bytes) -> None:
        if len(data) > self.cache_bytes:
            return
        with self._lock:
            if extent in self._cache:
                return
            self._cache[extent] = data
            self._cached += len(data)
            while self._cached > self.cache_bytes:
                _, dropped = self._cache.popitem(last=False)
                self._cached -= len(dropped)

    def _fetch(self, extent: Extent) -> bytes:
        data = self.store.read_range(extent.file, extent.start, extent.length)
        with self._lock:
            self.stats.requests += 1
            self.stats.bytes += len(data)
        self._remember(extent, data)
        return data

    def read_many(self, extents: Sequence[Extent]) -> list[bytes]:
        """The bytes of each extent, in order; the misses are fetched in parallel."""
        began = time.perf_counter()
        found = [self._lookup(e) for e in extents]
        futures = {i: self._pool.submit(self._fetch, e) for i, e in enumerate(extents) if found[i] is None}
        out = [found[i] if found[i] is not None else futures[i].result() for i in range(len(extents))]
        self.stats.seconds += time.perf_counter() - began
        return out  # type: ignore[return-value]

    @property
    def cached_bytes(self) -> int:
        return self._cached

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def decode(chunks: Sequence[bytes], dtype: np.dtype[np.generic]) -> npt.NDArray[np.int64]:
    """Equal-length raw token chunks as one (rows, tokens) int64 array."""
    rows = [np.frombuffer(chunk, dtype=dtype) for chunk in chunks]
    return np.stack(rows).astype(np.int64)
