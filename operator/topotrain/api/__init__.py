"""The TrainingJob API (topotrain.io/v1alpha1): what a user writes and reads.

`spec.py` holds the job's models, `pod.py` the pod-template part (the worker, its
environment, volumes, labels and annotations), `status.py` the status models with the
condition types and reasons, `validation.py` the CEL rules and the checks of a whole
manifest (with the spec's side of the data-degree rule of `topotrain.degrees`), and
`crd.py` generates the CRD from them. Pure data and its rules: this package imports only
the shared top-level modules (`contract`, `checkpoints`, `degrees`, `s3client`), never
`placement`, `core`, `controller` or `cli` (the import-linter contract in pyproject.toml).
"""
