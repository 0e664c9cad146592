"""topotrain_sdk.job() and the DeviceMesh layout: what a trainer reads of its place in the job."""

from __future__ import annotations

import itertools

import pytest

from topotrain_sdk.contract import ContractError, rank_of
from topotrain_sdk.job import job
from topotrain_sdk.mesh import mesh_layout, mesh_ranks

POD = {"TOPOTRAIN_JOB_NAME": "llm", "TOPOTRAIN_JOB_NAMESPACE": "team", "NNODES": "4",
       "NPROC_PER_NODE": "2", "NODE_RANK": "1", "TOPOTRAIN_TP": "2", "TOPOTRAIN_PP": "2",
       "TOPOTRAIN_DP": "2", "TOPOTRAIN_ATTEMPT": "3", "TOPOTRAIN_RESUME_STEP": "40",
       "TOPOTRAIN_CHECKPOINT_URI": "s3://b/jobs/team/llm", "TOPOTRAIN_CHECKPOINT_INTERVAL": "20",
       "TOPOTRAIN_CHECKPOINT_KEEP": "2", "TOPOTRAIN_TRAINING_CONFIG": '{"holdAtStep": 6}',
       "LOCAL_RANK": "1", "RANK": "3"}  # fmt: skip


def test_inside_a_training_job_the_pod_environment_describes_the_job() -> None:
    described = job(POD)
    assert described.in_training_job and described.name == "llm" and described.namespace == "team"
    assert (described.rank, described.local_rank, described.world_size) == (3, 1, 8)
    assert described.mesh_sizes == {"tensor": 2, "pipeline": 2, "data": 2}
    assert described.coords == {"tensor": 1, "pipeline": 1, "data": 0}  # tp-pp-dp: 3 = (0*2+1)*2+1
    assert (described.attempt, described.resume_step) == (3, 40)
    assert described.checkpoint_prefix == "s3://b/jobs/team/llm"
    assert (described.checkpoint_interval, described.checkpoint_keep) == (20, 2)
    assert described.training == {"holdAtStep": 6}


def test_outside_a_training_job_a_script_runs_alone_or_under_plain_torchrun() -> None:
    alone = job({})
    assert not alone.in_training_job and (alone.rank, alone.world_size) == (0, 1)
    assert alone.resume_step is None and alone.checkpoint_prefix == ""
    torchrun = job({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert (torchrun.rank, torchrun.world_size, torchrun.mesh_sizes["data"]) == (1, 2, 2)


@pytest.mark.parametrize(("key", "value"), [("TOPOTRAIN_TP", "two"), ("RANK", "8"),
                                            ("TOPOTRAIN_TRAINING_CONFIG", "[1]")])
def test_a_broken_contract_names_the_variable(key: str, value: str) -> None:
    with pytest.raises(ContractError, match=key):
        job({**POD, key: value})


@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp"])
@pytest.mark.parametrize(("tp", "pp", "dp"), [(2, 2, 2), (4, 1, 3), (1, 3, 2), (2, 3, 1)])
def test_the_mesh_puts_every_rank_where_the_operator_placed_it(
    order: str, tp: int, pp: int, dp: int
) -> None:
    """Row-major over the layout (outermost first), every rank sits at the coordinates the
    contract's rank order gives it: its tensor/pipeline/data groups are the ones placed together."""
    world = tp * pp * dp
    env = {"TOPOTRAIN_JOB_NAME": "j", "NNODES": str(world), "NPROC_PER_NODE": "1",
           "TOPOTRAIN_TP": str(tp), "TOPOTRAIN_PP": str(pp), "TOPOTRAIN_DP": str(dp),
           "TOPOTRAIN_RANK_ORDER": order}  # fmt: skip
    shape, names = mesh_layout(job(env), {"data": "dp_shard"})
    assert names == (("dp_shard", "pp", "tp") if order == "tp-pp-dp" else ("pp", "dp_shard", "tp"))
    for flat, index in enumerate(itertools.product(*(range(n) for n in shape))):
        at = dict(zip(names, index, strict=True))
        assert rank_of(at["tp"], at["pp"], at["dp_shard"], tp, pp, dp, order) == flat


@pytest.mark.parametrize("names", [{"expert": "ep"}, {"data": "tp"}])
def test_mesh_names_must_be_the_three_dimensions_each_once(names: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="names="):
        mesh_layout(job({}), names)


@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp"])
def test_a_framework_that_lays_out_its_own_mesh_gets_the_operators_groups(order: str) -> None:
    """torchtitan unflattens its world pp-outermost: over `mesh_ranks` it gets, at each of its
    (pp, dp, tp) positions, the rank the operator placed there, in either rank order."""
    tp, pp, dp = 2, 3, 2
    env = {"TOPOTRAIN_JOB_NAME": "j", "NNODES": "6", "NPROC_PER_NODE": "2", "TOPOTRAIN_TP": "2",
           "TOPOTRAIN_PP": "3", "TOPOTRAIN_DP": "2", "TOPOTRAIN_RANK_ORDER": order}  # fmt: skip
    ranks = mesh_ranks(job(env), ("pipeline", "data", "tensor"))
    assert sorted(ranks) == list(range(tp * pp * dp))
    positions = itertools.product(range(pp), range(dp), range(tp))
    assert [rank_of(t, p, d, tp, pp, dp, order) for p, d, t in positions] == ranks
    if order == "tp-dp-pp":  # torchtitan's own layout: nothing to reorder
        assert ranks == list(range(tp * pp * dp))
    with pytest.raises(ValueError, match="layout="):
        mesh_ranks(job(env), ("pipeline", "tensor"))
