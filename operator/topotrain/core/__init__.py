"""Every decision the operator makes, as pure functions of typed inputs.

The reconciler (`reconcile.py`, its branches in `reconcile_*.py`, the types it takes and
returns in `decision.py`), the status it builds (`StatusBuilder` in `reconcile_status.py`,
`status_lifecycle.py`, `status_edits.py`, settled into the pass's one write by
`transitions.py`), the failure policy (`policy.py`, `node_failures.py`), elastic sizing (`elastic.py`), in-place restarts (`inplace.py`), planned
changes (`planned.py`), the planner's adapters (`planning.py`), Kueue Workloads and their
admission (`kueue.py`, `kueue_admission.py`), the children's manifests (`manifests.py`, `rank_table.py`) and
ownership (`ownership.py`). Nothing here reads a clock (`now` is an input) or calls an API:
this package imports only `api`, `placement` and the shared top-level modules, never
`controller`, `cli`, kopf, the Kubernetes client or boto3 (the import-linter contract in
pyproject.toml), so every decision is tested without a cluster.
"""
