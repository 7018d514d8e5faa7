"""The layering contract in pyproject.toml ([tool.importlinter]) holds, and can fail.

`lint-imports` (import-linter) builds the import graph of the package, lazy imports inside
functions included, and checks that no module imports from a layer above its own. Negative
control: a copy of the package with one upward import added (state -> optimizer) breaks it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    assert "zerokern.state is not allowed to import zerokern.optimizer" in out.stdout
