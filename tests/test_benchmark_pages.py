"""The benchmark tables of docs/benchmarks.md and the README equal what benchmarks/results/*.json
give (benchmarks/render.py, [Note: one source for a benchmark number]), so CI fails on a number
edited by hand or a result file rerun without `render.py --write`; with negative controls that
edit a copy of the pages and see the check fail."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_render", REPO / "benchmarks" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

# a number inside the rendered step table (stage 0's median iteration, ms) and what the hand
# edit turns it into
STEP_CELL = "| zerokern stage 0 | 223 (218-226) |"
EDITED_CELL = "| zerokern stage 0 | 213 (218-226) |"


@pytest.fixture
def checkout(tmp_path):
    """A copy of the pages and the result files, to edit without touching the repository."""
    for page in render.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, tmp_path / page)
    shutil.copytree(REPO / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    return tmp_path


def test_pages_match_the_results():
    problems = render.check()
    assert problems == [], "\n\n".join(problems) + (
        "\n\nrun `python benchmarks/render.py --write` after rerunning a benchmark")


def test_every_page_renders_tables():
    names = {m.group("name") for page in render.PAGES
             for m in render.REGION.finditer((REPO / page).read_text())}
    assert names == set(render.TABLES), names ^ set(render.TABLES)


def test_a_hand_edited_number_fails_the_check(checkout):
    page = checkout / "docs/benchmarks.md"
    text = page.read_text()
    assert STEP_CELL in text   # the control edits a cell that is really there
    page.write_text(text.replace(STEP_CELL, EDITED_CELL))
    problems = render.check(checkout)
    assert len(problems) == 1, problems
    assert "table `step-20m-fp32` differs" in problems[0]
    assert "-" + EDITED_CELL in problems[0] and "+" + STEP_CELL in problems[0], problems[0]
    # the command line says so too, with a non-zero exit, and --write repairs the copy
    cli = [sys.executable, str(REPO / "benchmarks/render.py"), "--root", str(checkout)]
    out = subprocess.run(cli + ["--check"], capture_output=True, text=True)
    assert out.returncode == 1 and "step-20m-fp32" in out.stderr, out
    assert subprocess.run(cli + ["--write"], capture_output=True).returncode == 0
    assert page.read_text() == text and render.check(checkout) == []


def test_a_rerun_result_fails_the_check_until_written(checkout):
    path = checkout / "benchmarks/results/kernels-cpu.json"
    data = json.loads(path.read_text())
    row = next(r for r in data["rows"] if (r["op"], r["case"], r["provider"], r["log2n"])
               == ("adam_step_", "bf16", "cpu", 26))
    row["median_ms"] *= 1.5
    path.write_text(json.dumps(data))
    problems = render.check(checkout)
    names = {p.split("`")[1] for p in problems}
    # the README's headline reads the same row as the kernel table
    assert names == {"kernels-adam", "headline"}, problems
    assert render.write(checkout) == list(render.PAGES)
    assert render.check(checkout) == []


def test_a_heading_twice_fails_the_check(checkout):
    page = checkout / "docs/benchmarks.md"
    page.write_text(page.read_text() + "\n## Training step\n\nstale copy\n")
    problems = render.check(checkout)
    assert problems == ["docs/benchmarks.md: heading appears twice: '## Training step'"], problems


def test_an_unknown_table_name_fails_the_check(checkout):
    page = checkout / "README.md"
    page.write_text(page.read_text() + "\n<!-- render: no-such-table -->\n<!-- /render -->\n")
    problems = render.check(checkout)
    assert len(problems) == 1 and "unknown table `no-such-table`" in problems[0], problems


def test_result_files_of_other_kinds_are_tolerated(checkout):
    results = checkout / "benchmarks/results"
    (results / "chaos-new-kind.json").write_text(json.dumps({"faults": [{"rank": 1}]}))
    (results / "half-written.json").write_text('{"rows": [')
    kinds = render.kinds(results)
    assert kinds["chaos-new-kind.json"] == "other"
    assert kinds["half-written.json"] == "unreadable"
    assert render.check(checkout) == []
    # every committed file is read without error; the kinds the tables use are recognized
    committed = render.kinds()
    assert "unreadable" not in committed.values(), committed
    for name, kind in (("step-20m-n2-fp32.json", "step"), ("kernels-cpu.json", "kernels"),
                       ("step-20m-n2-fp32-shm-paired.json", "paired"),
                       ("engine-20m-n2.json", "engine"), ("mesh-quant-2x2.json", "mesh"),
                       ("activations-small-n2-fp32.json", "activations"),
                       ("infinity-2b.json", "infinity"),
                       ("offload-nvme-20m-s2-bf16.json", "offload-nvme")):
        assert committed[name] == kind, (name, committed[name])


def test_each_rendered_table_names_its_run():
    for name, fn in render.TABLES.items():
        body = fn(render.RESULTS)
        assert "Run" in body and ".json`" in body, name
        for field in ("UTC", "commit", "load:"):
            assert field in body, (name, field)
