"""The layering contract in pyproject.toml ([tool.importlinter]) holds, and can fail; the code
map's list of layers (docs/code-map.md, "The layering contract") is the contract's, row by row.

`lint-imports` (import-linter) builds the import graph of the package, lazy imports inside
functions included, and checks that no module imports from a layer above its own. Negative
control: a copy of the package with one upward import added (state -> optimizer) breaks it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
           "--config", str(REPO / "pyproject.toml"), "--no-cache"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_layers():
    out = _lint(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(REPO / "zerokern", tmp_path / "zerokern",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    low = tmp_path / "zerokern" / "state" / "pinned.py"
    upward = "\n\ndef _upward():\n    from zerokern import optimizer  # noqa\n"
    low.write_text(low.read_text() + upward)
    out = _lint(tmp_path)
    assert out.returncode != 0, out.stdout
    assert "zerokern.state is not allowed to import zerokern.core.optimizer" in out.stdout


def contract_layers() -> list:
    """The contract's layers, top first, each a set of module names without `zerokern.`."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    layers = cfg["tool"]["importlinter"]["contracts"][0]["layers"]
    return [{m.strip().removeprefix("zerokern.") for m in row.split("|")} for row in layers]


def code_map_layers(text: str) -> list:
    """The numbered list under "## The layering contract" in the code map: one set a row."""
    section = text.split("## The layering contract", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\d+\. (.+)$", section, flags=re.M)
    return [{m.removeprefix("zerokern.") for m in re.findall(r"`([^`]+)`", row)} for row in rows]


def test_the_code_map_lists_the_contracts_layers():
    want = contract_layers()
    got = code_map_layers((REPO / "docs" / "code-map.md").read_text())
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want), 1):
        assert g == w, f"code map row {i}: {sorted(g)} vs the contract's {sorted(w)}"


def test_a_code_map_row_that_drifts_is_caught():
    text = (REPO / "docs" / "code-map.md").read_text()
    drifted = text.replace("1. `zerokern.cli`", "1. `zerokern.cli`, `zerokern.tools.spawn`", 1)
    assert drifted != text
    got, want = code_map_layers(drifted), contract_layers()
    assert got[0] != want[0] and got[1:] == want[1:]


def package_rows(layers: list) -> dict:
    """Top-level package -> the contract rows (0 = top) that hold its modules."""
    rows: dict = {}
    for i, row in enumerate(layers):
        for m in row:
            rows.setdefault(m.split(".")[0], set()).add(i)
    return rows


def gaps(layers: list) -> dict:
    """Packages whose modules sit in rows that other packages' rows interrupt (a folder that
    does not match the layers: issue 35)."""
    return {p: sorted(r) for p, r in package_rows(layers).items()
            if set(range(min(r), max(r) + 1)) != r}


def test_each_folder_is_one_run_of_layers():
    """A package's modules fill consecutive rows of the contract, so the folders show the
    layers (zerokern/layout/ held the bottom row's math beside buffers above state/ before
    geometry/ and memory/ were split out of layout/ and accounting/)."""
    assert gaps(contract_layers()) == {}


def test_a_folder_split_across_layers_is_caught():
    layers = contract_layers()
    moved = [set(r) for r in layers]
    moved[-1].add("layout.moved_down")  # a layout module at the bottom row
    assert "layout" in gaps(moved)


def lazy_imports_of_own_package(path: Path, package: str) -> list:
    """Imports inside functions of `path` (a package's __init__) of the package's own
    submodules: a loop from the interface down to its implementations that import-linter
    cannot see (issue 35)."""
    import ast

    tree = ast.parse(path.read_text())
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module and \
                        node.module.startswith(package + "."):
                    out.append(node.module)
    return out


def test_the_rule_interface_imports_no_rule():
    """zerokern/rules/__init__.py (the Rule interface) imported the concrete rules lazily, a
    hidden loop; the registry (rules/registry.py) imports them at its top."""
    assert lazy_imports_of_own_package(REPO / "zerokern" / "rules" / "__init__.py",
                                       "zerokern.rules") == []


def test_a_lazy_import_of_an_own_submodule_is_caught(tmp_path):
    f = tmp_path / "init.py"
    f.write_text("def f():\n    from zerokern.rules.adamw import ADAMW\n    return ADAMW\n")
    assert lazy_imports_of_own_package(f, "zerokern.rules") == ["zerokern.rules.adamw"]
