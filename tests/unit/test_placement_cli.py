"""`topotrain plan` on kubectl List documents: outputs and errors that name the file and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_placement import hgx
from test_placement_support import pod
from topotrain.cli.plan import main

JOB: dict[str, Any] = {
    "apiVersion": "topotrain.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "llm"},
    "spec": {
        "image": "trainer:1",
        "parallelism": {"tensor": 8, "pipeline": 2, "data": 3, "minData": 1},
        "worker": {"gpusPerPod": 8, "gpuTypes": ["H100-80GB"]},
    },
}


def write(tmp_path: Path, name: str, doc: Any) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    nodes = hgx([3, 3])
    pods = [pod("n0-0", 8, name="busy"), pod("n0-1", 8, labels={"topotrain.io/job": "llm"}, name="mine")]
    return {
        "nodes": write(tmp_path, "nodes.yaml", {"apiVersion": "v1", "kind": "List", "items": nodes}),
        "pods": write(tmp_path, "pods.yaml", {"apiVersion": "v1", "kind": "List", "items": pods}),
        "job": write(tmp_path, "job.yaml", JOB),
    }


def run(files: dict[str, Path], *extra: str) -> list[str]:
    return ["--nodes", str(files["nodes"]), "--pods", str(files["pods"]), "--job", str(files["job"]), *extra]


def test_json(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(run(files, "--output", "json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"feasible", "reason", "pool", "parallelism", "pods", "cost", "stepTime"}
    assert doc["feasible"] is True and doc["reason"] is None and doc["pool"] == "H100-80GB"
    assert doc["parallelism"] == {"tensor": 8, "pipeline": 2, "data": 2}  # 5 free nodes: 4 pods, data 2
    assert [p["ranks"] for p in doc["pods"]] == [[0, 7], [8, 15], [16, 23], [24, 31]]
    assert "n0-0" not in {p["node"] for p in doc["pods"]}  # held by another pod; the job's own pod is ignored
    assert {"total", "nvlink", "rack", "block"} <= set(doc["cost"])


def test_table_and_not_placeable(files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(run(files)) == 0
    out = capsys.readouterr().out
    assert "pool H100-80GB  tp=8 pp=2 dp=2" in out and "RANKS" in out and "0-7" in out
    big = {**JOB, "spec": {**JOB["spec"], "parallelism": {"tensor": 8, "pipeline": 2, "data": 8}}}
    files["job"] = write(tmp_path, "big.yaml", big)
    assert main(run(files, "-o", "json")) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] is False and doc["pods"] == [] and doc["parallelism"] is None and doc["stepTime"] is None
    assert doc["reason"] == "pool H100-80GB: 40 free GPUs in 5 nodes, need 128 (16 pods x 8)"


def test_svg_draws_every_gpu_and_colours_the_gang(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(run(files, "-o", "svg")) == 0
    svg = capsys.readouterr().out
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    gpus = svg.count("<title>")
    assert gpus == 6 * 8
    assert svg.count('fill="hsl(') == 4 * 8  # the gang's 32 ranks
    assert svg.count('fill="#bbb"') == 8  # the other job's pod
    assert "block b0" in svg and "rack nr1" in svg


@pytest.mark.parametrize(
    ("target", "content", "message"),
    [
        ("nodes", None, "nodes.yaml: No such file or directory"),
        ("nodes", "items: [\n", "nodes.yaml: not valid YAML"),
        ("nodes", {"kind": "PodList", "items": [{"kind": "Pod", "metadata": {"name": "x"}}]},
         "nodes.yaml: items[0].kind: expected Node, got Pod"),
        ("nodes", {"kind": "List", "items": [{"metadata": {}}]}, "nodes.yaml: items[0].metadata.name: required"),
        ("nodes", {"kind": "List", "items": [{"metadata": {"name": "n"}, "status": {"allocatable": {"nvidia.com/gpu": "lots"}}}]},
         "nodes.yaml: node n: status.allocatable.nvidia.com/gpu: not a GPU count: 'lots'"),
        ("pods", {"kind": "List", "items": [{"metadata": {"name": "p", "namespace": "a"}, "spec": {"nodeName": "n0-0",
          "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "x"}}}]}}]},
         "pods.yaml: pod a/p: container c: resources.requests.nvidia.com/gpu: not a GPU count: 'x'"),
        ("job", {**JOB, "spec": {**JOB["spec"], "parallelism": {"tensor": 8, "data": 0}}},
         "job.yaml: spec.parallelism.data: Input should be greater than or equal to 1"),
        ("job", "- a list\n", "job.yaml: expected a TrainingJob manifest (a mapping), got list"),
    ],
)
def test_bad_input_names_file_and_field(
    files: dict[str, Path], target: str, content: Any, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if content is None:
        files[target].unlink()
    else:
        write(files[target].parent, files[target].name, content)
    assert main(run(files)) == 2
    assert message in capsys.readouterr().err


def test_wired_into_topotrain_cli(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from topotrain.cli.main import main as topotrain_main

    assert topotrain_main(["plan", *run(files, "-o", "json")]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"] is True


def test_plan_chooses_only_allowed_data_degrees(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """5 free nodes hold 2 replicas, but the job allows only 1 or 4: the CLI plans data=1."""
    par = {"tensor": 8, "pipeline": 2, "data": 4, "minData": 1, "allowedData": [1, 4]}
    files["job"] = write(tmp_path, "allowed.yaml", {**JOB, "spec": {**JOB["spec"], "parallelism": par}})
    assert main(run(files, "-o", "json")) == 0
    assert json.loads(capsys.readouterr().out)["parallelism"] == {"tensor": 8, "pipeline": 2, "data": 1}


def test_plan_refuses_a_data_degree_the_trainer_rejects(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = {**JOB["spec"], "training": {"globalBatch": 64}}  # 64 % (2*3): data=3 can never run
    files["job"] = write(tmp_path, "batch.yaml", {**JOB, "spec": spec})
    assert main(run(files)) == 2
    assert "spec.parallelism.data=3 is not an allowed data degree: training.globalBatch=64" in (
        capsys.readouterr().err
    )


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("fleet", "job", "status"), [
    ("two-pool.yaml", "elastic-two-pools.yaml", 0),
    ("nvl72.yaml", "large-3d.yaml", 1),  # read, and planned: H100s are asked for, the fleet has GB200s
])
def test_plan_reads_the_example_fleets(fleet: str, job: str, status: int,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The README's commands: `--nodes` takes a fleet file (the testbed's topology files) as well
    as a Node List (issue 36: it failed with "expected a List of Node objects ... got None")."""
    args = ["--nodes", str(ROOT / "examples" / "clusters" / fleet), "--job", str(ROOT / "examples" / job)]
    assert main([*args, "--output", "json"]) == status, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] == (status == 0) and (doc["pods"] or doc["reason"])


def test_a_fleet_files_preload_holds_gpus_and_its_errors_name_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = {"name": "f", "pools": [{"name": "h", "product": "H100-80GB", "gpusPerNode": 8,
                                      "racksPerBlock": 1, "nodesPerRack": 6,
                                      "preload": {"everyNthNode": 1, "gpus": 1}}]}
    files = {"nodes": write(tmp_path, "fleet.yaml", fleet), "job": write(tmp_path, "job.yaml", JOB)}
    args = ["--nodes", str(files["nodes"]), "--job", str(files["job"])]
    assert main(args) == 1  # every node has 7 free GPUs: no 8-GPU pod fits
    assert "not placeable" in capsys.readouterr().out
    fleet["pools"][0]["nodesPerRack"] = 0
    write(tmp_path, "fleet.yaml", fleet)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "fleet.yaml" in err and "nodes_per_rack must be >= 1" in err


def test_the_plan_shows_its_predicted_step_time(
        files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The step-time model (docs/placement.md) on the printed plan, for spec.training's model and
    batch; `--step-model` overrides its table and a bad override names the file and field."""
    llama = {**JOB, "spec": {**JOB["spec"], "training": {"model": "8B", "seqLen": 4096, "globalBatch": 96,
                                                         "microBatch": 1}}}
    files["job"] = write(tmp_path, "llama.yaml", llama)
    assert main(run(files)) == 0
    out = capsys.readouterr().out
    assert "predicted step " in out and "compute " in out and "TP " in out and "bubble " in out
    assert "model 8B, seqLen 4096, globalBatch 96, microBatch 1; H100-80GB at 40% of 989" in out
    assert main(run(files, "-o", "json")) == 0
    step = json.loads(capsys.readouterr().out)["stepTime"]
    parts = ("compute", "tensor", "pipeline", "data", "bubble")
    assert step["seconds"] == pytest.approx(sum(step[k] for k in parts)) and step["microbatches"] == 48
    # 4 pods on the 2 free nodes of rack 0 and 3 of rack 1: a pipeline pair and the DP rings cross racks
    assert step["levels"] == {"tensor": "nvlink", "pipeline": "block", "data": "block"}
    override = write(tmp_path, "links.json", '{"links": {"block": {"bandwidthGBps": 2.5}}, "utilisation": 0.8}')
    assert main(run(files, "-o", "json", "--step-model", str(override))) == 0
    slower_links = json.loads(capsys.readouterr().out)["stepTime"]
    assert slower_links["data"] > 5 * step["data"] and slower_links["compute"] == pytest.approx(step["compute"] / 2)
    bad = write(tmp_path, "bad.json", '{"links": {"rack": {"latencyUs": -3}}}')
    assert main(run(files, "--step-model", str(bad))) == 2
    assert f"{bad}: links.rack.latencyUs: must be >= 0" in capsys.readouterr().err


def test_a_plan_on_a_gpu_of_unknown_peak_says_why_it_has_no_step_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = write(tmp_path, "t4.yaml", {"apiVersion": "v1", "kind": "List", "items": hgx([2], product="T4")})
    job = write(tmp_path, "job.yaml", {**JOB, "spec": {**JOB["spec"], "parallelism": {"tensor": 8, "pipeline": 1,
                                                                                      "data": 2},
                                                       "worker": {"gpusPerPod": 8, "gpuTypes": ["T4"]}}})
    assert main(["--nodes", str(nodes), "--job", str(job), "-o", "json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["stepTime"] is None and json.loads(captured.out)["feasible"] is True
    assert "step time not predicted: GPU product 'T4': no peak BF16 TFLOPS known" in captured.err
