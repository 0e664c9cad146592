"""The operator's edge: where the pure decisions of `core` meet kopf, the API server and S3.

`main.py` holds only the kopf registrations (and `topotrain run`); `loop.py` is one job's
reconcile loop (observe in `observe.py` and `queue_link.py`, decide with `core`, act in
`act.py`, write the status `core` settled once, never editing it); `process.py` the state
the loops share; `kube.py` the API client (`status_patch.py` its status write's patch);
`indexes.py` what the watch indexes keep and `snapshot.py` a pass's view of them;
`fleet.py` the free GPUs kept from the watch; `settings.py`, `metrics.py`, `health.py` and
`kopf_readiness.py` the process's configuration and probes. It may import every layer below
(`core`, `placement`, `api`, the shared modules); it is the only package that imports kopf,
and `kube.py` is the only module that imports the Kubernetes client (the import-linter
contract in pyproject.toml).
"""
