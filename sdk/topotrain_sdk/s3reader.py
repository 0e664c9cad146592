"""A DCP StorageReader that reads each rank's byte ranges straight from S3.

DCP's `.metadata` maps every stored chunk (a tensor shard, or a pickled object)
to `(file, offset, length)`. DCP's load planner tells each rank which chunks
it needs for its own shards of the current mesh; this reader fetches exactly
those byte ranges with parallel ranged GETs and never writes the checkpoint to
local disk. A rank therefore reads about its share of a step (plus the small
replicated objects) instead of the whole step per machine.

Bounds:
- ranges of one file at most `gap_bytes` apart are merged into one GET (the gap
  is read and dropped), up to `part_bytes` per GET. The gap stays small (4 KiB):
  rank 0's file interleaves the small chunks every rank needs (replicated
  counters) with its own shards, and a wide gap would read those shards too;
  a chunk larger than `part_bytes` is fetched as several parts in parallel;
- at most `workers` GETs run at once, and at most `window_bytes` of fetched
  data wait in memory to be copied into the rank's tensors: the local buffer
  is bounded whatever the checkpoint's size. Ranges are decoded in file order
  on the calling thread (DCP's planner is not thread-safe).
"""

from __future__ import annotations

import io
import pickle
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future as TorchFuture

from topotrain_sdk.checkpoints import CheckpointStore

METADATA = ".metadata"
MiB = 1 << 20


@dataclass
class ReadStats:
    """What one rank's restore fetched."""

    bytes: int = 0  # bytes received (ranges, including merged gaps, and .metadata)
    requests: int = 0  # GETs
    items: int = 0  # DCP chunks decoded
    seconds: float = 0.0  # wall time in read_data and read_metadata


@dataclass
class _Range:
    """One or more chunks of one file, fetched as `parts` (start, length) GETs and joined."""

    name: str
    start: int
    end: int
    members: list[tuple[ReadItem, Any]] = field(default_factory=list)

    def parts(self, part_bytes: int) -> list[tuple[int, int]]:
        return [(s, min(part_bytes, self.end - s)) for s in range(self.start, self.end, part_bytes)]


def plan_ranges(
    items: list[tuple[ReadItem, Any]], gap_bytes: int, part_bytes: int
) -> list[_Range]:
    """Chunks (with their `_StorageInfo`) grouped into GET ranges, in file and offset order."""
    ranges: list[_Range] = []
    for req, info in sorted(items, key=lambda it: (it[1].relative_path, it[1].offset)):
        start, end = int(info.offset), int(info.offset) + int(info.length)
        last = ranges[-1] if ranges else None
        if (
            last is not None and last.name == info.relative_path
            and start <= last.end + gap_bytes and max(end, last.end) - last.start <= part_bytes
        ):  # fmt: skip
            last.end = max(last.end, end)
            last.members.append((req, info))
        else:
            ranges.append(_Range(info.relative_path, start, end, [(req, info)]))
    return ranges


class S3RangeReader(FileSystemReader):
    """Loads a committed step's attempt directory `shards` from the store, by byte range."""

    def __init__(
        self,
        store: CheckpointStore,
        step: int,
        shards: str = "",
        *,
        workers: int = 8,
        window_bytes: int = 256 * MiB,
        gap_bytes: int = 4096,
        part_bytes: int = 16 * MiB,
    ) -> None:
        super().__init__(f"{store.step_uri(step)}/{shards}")  # a label only: nothing local is read
        self.store, self.step, self.shards = store, step, shards
        self.workers, self.window_bytes = workers, window_bytes
        self.gap_bytes, self.part_bytes = gap_bytes, part_bytes
        self.stats = ReadStats()

    def _key(self, name: str) -> str:
        return self.store.shard_key(self.step, name, shards=self.shards)

    def _get(self, name: str, start: int, length: int) -> bytes:
        return self.store.read_range(self._key(name), start, length)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        began = time.perf_counter()
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        body = self.store.client.get_object(Bucket=self.store.bucket, Key=self._key(name))["Body"].read()
        metadata = cast(Metadata, pickle.loads(body))  # written by our own trainer's DCP save
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        self.stats.bytes += len(body)
        self.stats.requests += 1
        self.stats.seconds += time.perf_counter() - began
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        began = time.perf_counter()
        items = [(req, self.storage_data[req.storage_index]) for req in plan.items]
        ranges = plan_ranges(items, self.gap_bytes, self.part_bytes)
        in_flight: deque[tuple[_Range, list[Future[bytes]]]] = deque()
        buffered = 0
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="topotrain-get") as pool:
            for span in ranges:
                size = span.end - span.start
                while in_flight and buffered + size > self.window_bytes:
                    buffered -= self._decode(*in_flight.popleft(), planner)
                parts = [pool.submit(self._get, span.name, s, n) for s, n in span.parts(self.part_bytes)]
                in_flight.append((span, parts))
                buffered += size
            while in_flight:
                self._decode(*in_flight.popleft(), planner)
        self.stats.seconds += time.perf_counter() - began
        done: TorchFuture[None] = TorchFuture()
        done.set_result(None)
        return done

    def _decode(self, span: _Range, parts: list[Future[bytes]], planner: LoadPlanner) -> int:
        """Copy a fetched range's chunks into the planner's tensors; returns its size."""
        data = b"".join(part.result() for part in parts)
        self.stats.bytes += len(data)
        self.stats.requests += len(parts)
        view = memoryview(data)
        for req, info in span.members:
            offset = int(info.offset) - span.start
            raw = io.BytesIO(view[offset : offset + int(info.length)])
            stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), raw)
            self.stats.items += 1
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(stream.read(-1)))
                continue
            seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
            tensor = cast(torch.Tensor, torch.load(seekable, map_location="cpu", weights_only=True))
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise ValueError(f"{req.storage_index}: stored {tuple(tensor.size())}, "
                                 f"expected {tuple(target.size())}")  # fmt: skip
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        return span.end - span.start
