"""The package's layers (docs/architecture.md): the import-linter contract in pyproject.toml
passes on the code as it is and names a forbidden import planted in a copy of it; and no
module of the repository is part of an import cycle."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"operator": "topotrain", "trainer_image": "topotrain_trainer", "sdk": "topotrain_sdk"}


def copy_of_the_packages(tmp_path: Path) -> Path:
    for folder, package in PACKAGES.items():
        shutil.copytree(ROOT / folder / package, tmp_path / folder / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on the copy in `tree`, with pyproject.toml's contracts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / folder) for folder in PACKAGES)}
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())", "--no-cache", "--no-logo", str(tree / "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def test_the_contract_holds(tmp_path: Path) -> None:
    result = lint_imports(copy_of_the_packages(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "planted", "contract", "names"), [
    ("operator/topotrain/core/policy.py", "import kopf", "only the controller imports kopf",
     "topotrain.core.policy -> kopf"),
    ("operator/topotrain/core/manifests.py", "import boto3", "core imports no kopf, Kubernetes client or boto3",
     "topotrain.core.manifests -> boto3"),
    ("operator/topotrain/controller/loop.py", "import kubernetes",
     "only controller/kube.py imports the Kubernetes client", "topotrain.controller.loop -> kubernetes"),
    ("operator/topotrain/api/spec.py", "from topotrain.core import policy",
     "each layer of topotrain imports only the layers below it", "topotrain.api.spec -> topotrain.core.policy"),
    ("operator/topotrain/degrees.py", "from topotrain.api import spec",
     "each layer of topotrain imports only the layers below it", "topotrain.degrees -> topotrain.api.spec"),
    ("trainer_image/topotrain_trainer/config.py", "import topotrain.placement.topology",
     "the trainer imports only topotrain's shared modules",
     "topotrain_trainer.config -> topotrain.placement.topology"),
])
def test_a_planted_import_breaks_the_contract_that_forbids_it(
    tmp_path: Path, module: str, planted: str, contract: str, names: str,
) -> None:
    tree = copy_of_the_packages(tmp_path)
    target = tree / module
    target.write_text(target.read_text() + f"\n{planted}  # planted by the test\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert f"{contract} BROKEN" in result.stdout, result.stdout
    assert names in result.stdout, result.stdout


# --- import cycles, anywhere in the repository -------------------------------------------------

# Where each tree's modules are imported from: bench/ scripts run with bench/ on sys.path, so
# they import each other by their bare names.
TREES = {"operator/topotrain": "operator", "trainer_image/topotrain_trainer": "trainer_image",
         "sdk/topotrain_sdk": "sdk",
         "testbed": ".", "tests": ".", "scripts": ".", "bench": "bench"}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for tree, base in TREES.items():
        for path in sorted((ROOT / tree).rglob("*.py")):
            parts = list(path.relative_to(ROOT / base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports anywhere (in functions and under
    TYPE_CHECKING too), other than its own submodules (a package's face)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parents, *([node.module] if node.module else [])])
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    out = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name and not target.startswith(name + "."):
            out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> Iterator[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        yield sorted(component)


def test_no_module_is_part_of_an_import_cycle() -> None:
    known = modules()
    assert {"topotrain.core.reconcile", "topotrain_trainer.config", "testbed.cluster", "versus"} <= set(known)
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert list(cycles(graph)) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert list(cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})) == [["a", "b", "c"]]
