"""The `topotrain` command: `crd`, `plan`, `run`, `--version` (`main.py`; `plan.py` is `topotrain plan`).

The top layer: it may import every package below it (`run` starts `controller.main`),
and nothing in the package imports it (the import-linter contract in pyproject.toml).
"""
