"""benchmarks/project_mesh.py (issue 40): the projection's byte formulas equal the counters
comm_stats() measured on the 2 x 2 run (per config and group), a counter off by a payload
makes the check fail, and the tables in docs/guides/multi-node.md are the script's output (a
hand-edited number fails)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pm():
    spec = importlib.util.spec_from_file_location("project_mesh",
                                                  REPO / "benchmarks" / "project_mesh.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def measured(pm):
    return json.loads(pm.MEASURED.read_text())


def test_formulas_equal_the_measured_counters(pm, measured):
    checks = pm.check(measured)
    assert {c["config"] for c in checks} == set(pm.CONFIGS)
    assert all(abs(c["diff"]) <= 400 for c in checks)


def test_a_counter_off_by_one_payload_fails_the_check(pm, measured):
    bad = copy.deepcopy(measured)
    run = pm.one_run(bad)
    row = next(r for r in run["rows"] if r["config"] == "hpz_q8")
    m = run["mesh"]
    row["dims"]["cross"] += int(pm.wire(m["E"] / 4, 8))  # qwZ's payload crossing twice
    with pytest.raises(SystemExit, match="hpz_q8 cross"):
        pm.check(bad)


def test_docs_page_holds_the_projection(pm, measured):
    md = pm.markdown(pm.project(), pm.check(measured), pm.MEASURED.name)
    page = pm.DOCS.read_text()
    assert pm.page_with(md, page) == page
    edited = page.replace(" | ", " |  ", 1) if pm.REGION[0] not in page else \
        page[:page.index(pm.REGION[0]) + len(pm.REGION[0])] + "| x" + \
        page[page.index(pm.REGION[0]) + len(pm.REGION[0]):]
    assert pm.page_with(md, edited) != edited
