"""The rank table: ConfigMap `<job>-ranks`, which node holds which ranks in the current attempt.

Written by the controller with each launch (act.py), read back by the next passes
(`RankTable`) to finish a half-created gang and to re-plan only the lost pods of a recovery.
A ConfigMap holds at most 1 MiB: ranks.tsv is left out of a table too large for it, and the
placement is gzipped into binaryData past INLINE_LIMIT.
"""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from topotrain.api.spec import TrainingJobSpec
from topotrain.contract import rank_coords
from topotrain.core.manifests import JobMeta, labels, object_metadata


def rank_table_name(job: str) -> str:
    return f"{job}-ranks"


def rank_rows(spec: TrainingJobSpec, data: int, assignments: Mapping[int, str]) -> list[dict[str, Any]]:
    """One row per global rank: pod, local rank, mesh coordinates, node."""
    par, gpp = spec.parallelism, spec.worker.gpus_per_pod
    rows = []
    for rank in range(par.tensor * par.pipeline * data):
        tp, pp, dp = rank_coords(rank, par.tensor, par.pipeline, data, spec.rank_order)
        pod = rank // gpp
        rows.append({
            "rank": rank, "pod": pod, "localRank": rank % gpp, "tp": tp, "pp": pp, "dp": dp,
            "node": assignments.get(pod, ""),
        })
    return rows


# A ConfigMap holds at most 1 MiB. ranks.tsv (about 40 bytes a rank) goes in while the whole
# table stays under TABLE_BUDGET; placement.json is gzipped into binaryData past INLINE_LIMIT.
TABLE_BUDGET = 768 * 1024
INLINE_LIMIT = 256 * 1024
PLACEMENT = "placement.json"
PLACEMENT_GZ = "placement.json.gz"
MIN_ROW = 16  # bytes of the shortest ranks.tsv row


def rank_table(
    job: JobMeta, spec: TrainingJobSpec, attempt: int, data: int, pool: str | None,
    assignments: Mapping[int, str],
) -> dict[str, Any]:
    """ConfigMap `<job>-ranks`: which node holds which ranks in the current attempt."""
    fields = {"attempt": str(attempt), "data": str(data), "pool": pool or ""}
    binary: dict[str, str] = {}
    placement = json.dumps({str(i): n for i, n in sorted(assignments.items())})
    if len(placement) <= INLINE_LIMIT:
        fields[PLACEMENT] = placement
    else:  # mtime=0: the same placement always gives the same bytes, so re-applying changes nothing
        binary[PLACEMENT_GZ] = base64.b64encode(gzip.compress(placement.encode(), mtime=0)).decode()
    ranks = spec.parallelism.tensor * spec.parallelism.pipeline * data
    used = sum(len(v) for v in (*fields.values(), *binary.values()))
    if used + ranks * MIN_ROW <= TABLE_BUDGET:  # else the table cannot fit: do not build it
        table = _ranks_tsv(rank_rows(spec, data, assignments))
        if used + len(table) <= TABLE_BUDGET:
            fields["ranks.tsv"] = table
    if "ranks.tsv" not in fields:
        fields["ranksOmitted"] = (
            f"{ranks} ranks do not fit a ConfigMap: rank r runs on pod r // gpusPerPod "
            f"({spec.worker.gpus_per_pod}) as local rank r % gpusPerPod; {PLACEMENT} maps pods to nodes"
        )
    table_map: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": object_metadata(job, rank_table_name(job.name), labels(job.name, attempt)),
        "data": fields,
    }
    if binary:
        table_map["binaryData"] = binary
    return table_map


def _ranks_tsv(rows: list[dict[str, Any]]) -> str:
    lines = ["rank\tpod\tlocal\ttp\tpp\tdp\tnode"] + [
        f"{r['rank']}\t{r['pod']}\t{r['localRank']}\t{r['tp']}\t{r['pp']}\t{r['dp']}\t{r['node']}"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RankTable:
    """The placement of an earlier attempt, read back from the job's ConfigMap."""

    attempt: int
    data: int
    assignments: Mapping[int, str]


def parse_rank_table(data: Mapping[str, str]) -> tuple[int, int, dict[int, str]] | None:
    """(attempt, data degree, pod index -> node) from a rank-table ConfigMap's data and
    binaryData (base64 strings, as the API returns them), merged."""
    try:
        if PLACEMENT_GZ in data:
            placement = json.loads(gzip.decompress(base64.b64decode(data[PLACEMENT_GZ])))
        else:
            placement = json.loads(data.get(PLACEMENT, "{}"))
        return int(data["attempt"]), int(data["data"]), {int(k): str(v) for k, v in placement.items()}
    except (KeyError, ValueError, TypeError, AttributeError, OSError):
        return None
