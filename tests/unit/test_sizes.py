"""The size rule of operator/topotrain (docs/architecture.md, "Size"): no module over 400 lines
and no function over 60, except the ones the exception table there lists with a reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "operator" / "topotrain"
DOC = ROOT / "docs" / "architecture.md"
MODULE_LINES, FUNCTION_LINES = 400, 60
# A row of the exception table: | `operator/topotrain/x.py` or `operator/topotrain/x.py::name` | ...
ROW = re.compile(r"^\|\s*`(operator/topotrain/[^`]+)`\s*\|\s*[^|]*\|\s*([^|]*\S)\s*\|\s*$")


def exceptions(doc: str) -> dict[str, str]:
    """The exception table of the "Size" section: where -> why."""
    section = doc.split("\n## Size", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for line in section.splitlines() if (m := ROW.match(line))}


def oversized(package: Path, root: Path) -> dict[str, int]:
    """Every module over MODULE_LINES and function over FUNCTION_LINES: `path` or
    `path::qualified.name` -> its lines."""
    found: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        text = path.read_text()
        if (lines := len(text.splitlines())) > MODULE_LINES:
            found[where] = lines
        found.update({f"{where}::{name}": n for name, n in _functions(ast.parse(text), "")
                      if n > FUNCTION_LINES})
    return found


def _functions(node: ast.AST, prefix: str) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for child in ast.iter_child_nodes(node):
        name = getattr(child, "name", "")
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            assert child.end_lineno is not None
            out.append((prefix + name, child.end_lineno - child.lineno + 1))
        out += _functions(child, f"{prefix}{name}." if name else prefix)
    return out


def test_no_module_or_function_is_over_its_size_unless_the_doc_says_why() -> None:
    allowed = exceptions(DOC.read_text())
    found = oversized(PACKAGE, ROOT)
    unexplained = {where: n for where, n in found.items() if where not in allowed}
    assert not unexplained, (
        f"over {MODULE_LINES} lines (module) or {FUNCTION_LINES} (function): {unexplained}; split "
        "it along a seam, or list it with a reason under \"Size\" in docs/architecture.md")
    stale = sorted(set(allowed) - set(found))
    assert not stale, f"listed as exceptions in docs/architecture.md but within the rule now: {stale}"


def test_the_rule_names_an_oversized_module_and_function_and_honours_a_listed_one(tmp_path: Path) -> None:
    package = tmp_path / "operator" / "topotrain"
    (package / "core").mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (package / "core" / "big.py").write_text(
        f"class Pass:\n    def step(self) -> None:\n{body.replace('    x', '        x')}\n"
        + "\n" * 340)
    (package / "small.py").write_text(f"def fine() -> None:\n{body[:200]}\n")
    found = oversized(package, tmp_path)
    assert found == {"operator/topotrain/core/big.py": 403, "operator/topotrain/core/big.py::Pass.step": 62}
    doc = ("# A\n\n## Size\n\n| where | lines | why |\n|---|---|---|\n"
           "| `operator/topotrain/core/big.py::Pass.step` | 62 | one table, read top to bottom |\n\n## Next\n"
           "| `operator/topotrain/core/big.py` | 403 | outside the section: not an exception |\n")
    assert exceptions(doc) == {"operator/topotrain/core/big.py::Pass.step": "one table, read top to bottom"}
