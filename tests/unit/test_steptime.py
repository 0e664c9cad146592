"""The step-time model (placement/steptime.py): what a platform engineer would notice of it."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
from test_placement import hgx, inv, nvl, req
from topotrain.placement import Mesh, Plan, evaluate, plan
from topotrain.placement.cost import DomainIndex
from topotrain.placement.steptime import StepTime, predict, predict_plan
from topotrain.placement.steptime_tables import MODELS, Assumptions, StepTimeError, Workload

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = Workload(model="8B", seq_len=4096, global_batch=32, micro_batch=1)


def _index(nodes: list[dict[str, Any]], pool: str = "H100-80GB") -> tuple[DomainIndex, dict[str, int]]:
    index = DomainIndex(inv(nodes).pools()[pool])
    return index, {name: i for i, name in enumerate(index.names)}


def _step(request_kw: dict[str, int], index: DomainIndex, assign: list[int], workload: Workload = LLAMA_8B,
          product: str = "H100-80GB", assumptions: Assumptions | None = None) -> StepTime:
    return predict(Mesh.build(req(**request_kw)), index, assign, workload, product, assumptions)


def test_a_tp_group_split_across_racks_is_slower_than_inside_one_nvlink_domain() -> None:
    index, at = _index(nvl([2, 2], rack_per_clique=True), "GB200")  # two 2-node cliques, one per rack
    together = _step({"tensor": 8, "gpus_per_pod": 4}, index, [at["c0-0"], at["c0-1"]], product="GB200")
    split = _step({"tensor": 8, "gpus_per_pod": 4}, index, [at["c0-0"], at["c1-0"]], product="GB200")
    assert (together.levels["tensor"], split.levels["tensor"]) == ("nvlink", "block")
    assert split.tp > 5 * together.tp and split.total > together.total
    assert split.compute == together.compute


def test_a_dp_ring_across_two_blocks_is_slower_than_inside_one_block() -> None:
    index, at = _index(hgx([2, 2, 2], blocks=2))  # racks 0 and 2 in block b0, rack 1 in b1
    rack = _step({"data": 2}, index, [at["n0-0"], at["n0-1"]])
    block = _step({"data": 2}, index, [at["n0-0"], at["n2-0"]])
    cross = _step({"data": 2}, index, [at["n0-0"], at["n1-0"]])
    assert [s.levels["data"] for s in (rack, block, cross)] == ["rack", "block", "cross-block"]
    assert rack.dp < block.dp < cross.dp and rack.total < block.total < cross.total
    # the default table: 50, 25, 12.5 GB/s; the gradient shard dwarfs the latency
    assert cross.dp == pytest.approx(2 * block.dp, rel=0.01)


def test_rings_that_leave_a_rack_less_often_get_more_of_its_uplink() -> None:
    """Both gangs' DP rings cross racks of one block; two pods a rack share the rack's uplink
    between twice the GPUs, so their flows run at the NIC's 50 GB/s instead of 25."""
    index, at = _index(hgx([2, 2, 2, 2]))
    paired = _step({"data": 4}, index, [at["n0-0"], at["n0-1"], at["n1-0"], at["n1-1"]])
    spread = _step({"data": 4}, index, [at["n0-0"], at["n1-0"], at["n2-0"], at["n3-0"]])
    assert paired.levels["data"] == spread.levels["data"] == "block"
    assert spread.dp == pytest.approx(2 * paired.dp, rel=0.01)


def test_more_micro_batches_shrink_the_bubble() -> None:
    index, _ = _index(hgx([4]))
    fractions = []
    for batch in (8, 32, 128):
        step = _step({"pipeline": 4}, index, [0, 1, 2, 3], Workload("8B", 4096, batch, 1))
        assert step.microbatches == batch
        fractions.append(step.bubble / (step.total - step.dp))
    assert fractions == pytest.approx([3 / 11, 3 / 35, 3 / 131])  # (p-1)/(m+p-1)
    no_pipeline = _step({"data": 1}, index, [0], Workload("8B", 4096, 8, 1))
    assert no_pipeline.bubble == 0 and no_pipeline.pp == 0


def test_compute_follows_the_model_size_and_the_gpus_peak() -> None:
    assert MODELS["8B"].params == pytest.approx(8.03e9, rel=0.001)  # Llama 3 8B
    assert MODELS["70B"].params == pytest.approx(70.55e9, rel=0.001)
    index, _ = _index(hgx([1]) + hgx([1], product="A100-80GB", prefix="a"))
    h100 = _step({}, index, [0], LLAMA_8B)
    # 6 x params x tokens over 8 GPUs at 40% of 989 TFLOPS
    assert h100.compute == pytest.approx(6 * MODELS["8B"].params * 32 * 4096 / 8 / (989e12 * 0.4))
    a100 = _step({}, index, [0], LLAMA_8B, product="A100-80GB")
    assert a100.compute / h100.compute == pytest.approx(989 / 312)
    assert _step({}, index, [0], product="NVIDIA-H100-80GB-HBM3").compute == h100.compute  # family fallback


def test_overriding_the_table_changes_the_prediction() -> None:
    index, at = _index(hgx([2, 2], blocks=2))
    cross = [at["n0-0"], at["n1-0"]]
    default = _step({"data": 2}, index, cross)
    flat = {"bandwidthGBps": 50, "latencyUs": 8}  # uplinks as fast as the NIC: a non-blocking fabric
    faster = Assumptions.from_json({"links": {"block": flat, "crossBlock": flat}})
    assert _step({"data": 2}, index, cross, assumptions=faster).dp == pytest.approx(
        _step({"data": 2}, index, [at["n0-0"], at["n0-1"]]).dp)  # as fast as inside the rack now
    slower = _step({"data": 2}, index, cross, assumptions=Assumptions.from_json({"utilisation": 0.2}))
    assert slower.compute == pytest.approx(2 * default.compute) and slower.dp == default.dp
    own = _step({}, index, [0], product="X1", assumptions=Assumptions.from_json({"peakTflops": {"X1": 100}}))
    assert own.compute > default.compute


@pytest.mark.parametrize(("doc", "message"), [
    ({"links": {"rack": {"bandwidthGBps": -1}}}, "links.rack.bandwidthGBps: must be > 0"),
    ({"links": {"spine": {}}}, "links.spine: unknown level"),
    ({"utilisation": 1.5}, "utilisation: must be in (0, 1]"),
    ({"peakTflops": {"H100-80GB": "fast"}}, "peakTflops.H100-80GB: must be a number"),
    ({"mfu": 0.5}, "mfu: unknown"),
])
def test_a_bad_override_names_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(StepTimeError, match=re.escape(message)):
        Assumptions.from_json(doc)


def test_a_missing_or_infeasible_placement_is_refused() -> None:
    index, _ = _index(hgx([2]))
    with pytest.raises(StepTimeError, match=r"the placement has 1 pods; .* needs 2"):
        _step({"data": 2}, index, [0])
    with pytest.raises(StepTimeError, match="pod 1: node position 7 is not in the pool's 2 nodes"):
        _step({"data": 2}, index, [0, 7])
    with pytest.raises(StepTimeError, match="no placement to predict: pool H100-80GB: 16 free GPUs"):
        predict_plan(Plan.infeasible("pool H100-80GB: 16 free GPUs in 2 nodes, need 64"), req(data=8),
                     inv(hgx([2])).pools()["H100-80GB"], LLAMA_8B)
    with pytest.raises(StepTimeError, match="GPU product 'T4': no peak BF16 TFLOPS known"):
        _step({}, index, [0], product="T4")
    with pytest.raises(StepTimeError, match="globalBatch \\(2\\) is smaller than microBatch x data"):
        _step({"data": 2}, index, [0, 1], Workload("8B", 4096, 2, 2))
    with pytest.raises(StepTimeError, match=r"training\.model: '405B' is not one of"):
        Workload.from_training({"model": "405B"})
    with pytest.raises(StepTimeError, match=r"training\.seqLen: must be an integer >= 1"):
        Workload.from_training({"model": "8B", "seqLen": "4k"})


def test_a_planners_plan_is_predicted_on_its_pool() -> None:
    inventory = inv(hgx([4, 4]))
    request = req(pipeline=2, data=2)
    result = plan(request, inventory)
    step = predict_plan(result, request, inventory.pools()["H100-80GB"], Workload.from_training(
        {"model": "8B", "seqLen": 4096, "globalBatch": 32, "microBatch": 1}))
    assert step.levels == {"tensor": "nvlink", "pipeline": "rack", "data": "rack"}  # the gang in one rack
    assert step.microbatches == 16 and step.total > step.compute > 0


def test_where_the_cost_objective_and_the_step_time_disagree() -> None:
    """docs/placement.md's example: tp8 pp2 dp2 with one replica per rack of one block costs
    less than stages in two blocks, but the step time prefers the stages apart: the cost
    weighs a pipeline pair like a DP group, the DP ring moves ~10x more bytes."""
    index, at = _index(hgx([2, 2, 2], blocks=2))  # racks 0, 2 in block b0; rack 1 in b1
    mesh = Mesh.build(req(pipeline=2, data=2))  # pods: (stage 0, replica 0), (1, 0), (0, 1), (1, 1)
    replicas_by_rack = [at["n0-0"], at["n0-1"], at["n2-0"], at["n2-1"]]
    stages_by_block = [at["n0-0"], at["n1-0"], at["n0-1"], at["n1-1"]]
    assert evaluate(mesh, index, replicas_by_rack).total == 96
    assert evaluate(mesh, index, stages_by_block).total == 352
    a = predict(mesh, index, replicas_by_rack, LLAMA_8B, "H100-80GB")
    b = predict(mesh, index, stages_by_block, LLAMA_8B, "H100-80GB")
    assert (a.levels["data"], b.levels["data"], b.levels["pipeline"]) == ("block", "rack", "cross-block")
    assert b.total < a.total and b.dp + b.pp < a.dp


def test_the_model_table_matches_the_trainers() -> None:
    """The operator may not import the trainer: read its MODEL_CONFIGS from the source."""
    tree = ast.parse((REPO / "trainer_image/topotrain_trainer/shapes.py").read_text())
    table = next(n.value for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                 and isinstance(n.target, ast.Name) and n.target.id == "MODEL_CONFIGS")
    assert isinstance(table, ast.Dict)
    for key, call in zip(table.keys, table.values, strict=True):
        assert isinstance(key, ast.Constant) and isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
        shape = MODELS[key.value]
        args = [ast.literal_eval(a) for a in call.args] + [ast.literal_eval(k.value) for k in call.keywords]
        if call.func.id == "ModelConfig":
            assert args == [shape.dim, shape.layers, shape.heads, shape.kv_heads, shape.ffn], key.value
        else:
            assert args[:4] == [shape.dim, shape.layers, shape.heads, shape.ffn], key.value
            assert shape.vocab == {"llama3": 128256, "llama2": 32000}[call.func.id]
            assert shape.tied == (args[4:] == [True])
    assert len(table.keys) == len(MODELS)
    config = (REPO / "trainer_image/topotrain_trainer/config.py").read_text()
    assert "seq_len: int = 64\n" in config and Workload().seq_len == 64
