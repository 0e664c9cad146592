"""`device_mesh()`: a torch DeviceMesh in the operator's rank order, named as the user's
framework names its dimensions; `world_mesh()`: the world, ordered for a framework that lays its
mesh out itself (torchtitan). torch is imported here only."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from topotrain_sdk.contract import rank_of
from topotrain_sdk.job import DIMENSIONS, Job
from topotrain_sdk.job import job as current_job

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DEFAULT_NAMES = {"tensor": "tp", "pipeline": "pp", "data": "dp"}


def mesh_layout(job: Job, names: Mapping[str, str] | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dimension names), outermost first, of the mesh whose flat index is the global
    rank: what `init_device_mesh` takes. `names` maps "tensor"/"pipeline"/"data" to the user's
    names (e.g. {"pipeline": "pp", "data": "dp_shard", "tensor": "tp"})."""
    chosen = {**DEFAULT_NAMES, **(names or {})}
    unknown = sorted(set(chosen) - set(DIMENSIONS))
    if unknown:
        raise ValueError(f"device_mesh(names=...): unknown dimension(s) {unknown}; use {DIMENSIONS}")
    if len(set(chosen.values())) != len(DIMENSIONS):
        raise ValueError(f"device_mesh(names=...): two dimensions share a name: {chosen}")
    dims = job.mesh_dims()
    return tuple(size for _, size in dims), tuple(chosen[name] for name, _ in dims)


def device_mesh(
    names: Mapping[str, str] | None = None, *, device_type: str | None = None, job: Job | None = None,
) -> DeviceMesh:
    """A DeviceMesh over every rank, laid out in the job's rank order (`rankOrder`, innermost
    first), so each tensor/pipeline/data group is the set of ranks the operator placed together.
    Initializes the default process group if needed (env://; gloo on CPU, nccl on CUDA)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    described = job or current_job()
    device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    shape, dim_names = mesh_layout(described, names)
    return init_device_mesh(device, shape, mesh_dim_names=dim_names)


def mesh_ranks(job: Job, layout: Sequence[str]) -> list[int]:
    """The global ranks, row-major over `layout` (a framework's own dimension order, outermost
    first, of "tensor"/"pipeline"/"data"): position i holds the rank the operator placed at that
    position's coordinates. A framework that unflattens its world mesh in `layout` order over
    these ranks gets exactly the operator's tensor/pipeline/data groups, whatever `rankOrder`."""
    if sorted(layout) != sorted(DIMENSIONS):
        raise ValueError(f"layout={tuple(layout)}: must order each of {DIMENSIONS} once")
    env, sizes = job.env, job.mesh_sizes
    ranks = []
    for index in itertools.product(*(range(sizes[name]) for name in layout)):
        at = dict(zip(layout, index, strict=True))
        ranks.append(rank_of(at["tensor"], at["pipeline"], at["data"],
                             env.tensor, env.pipeline, env.data, env.rank_order))  # fmt: skip
    return ranks


def world_mesh(
    layout: Sequence[str], *, device_type: str | None = None, job: Job | None = None,
) -> DeviceMesh:
    """A one-dimensional DeviceMesh named "world" over every rank in `mesh_ranks(layout)` order,
    for a framework that builds its mesh by unflattening a world mesh: torchtitan unflattens
    pp-outermost, tp-innermost, so `world_mesh(("pipeline", "data", "tensor"))`. Initializes the
    default process group if needed, as `device_mesh` does."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    described = job or current_job()
    device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    ranks = torch.tensor(mesh_ranks(described, layout), dtype=torch.int)
    return DeviceMesh(device, ranks, mesh_dim_names=("world",))
