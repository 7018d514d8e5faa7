"""Result tables stay readable when piped to a log ([Note: tables in logs], zerokern/tools/tables.py)."""

import io

import pytest

from zerokern.tools import tables as tables

COLUMNS = [("provider", "provider"), ("ms", "iteration ms (p20-p80)"), ("x", "x DDP"),
           ("mib", "zerokern stage memory MiB/rank"), ("ms", "4 micro-batches: ms"),
           ("x", "N=4 x DDP"), ("mib", "N=4 MiB/rank")]
ROWS = [{"provider": "DDP + ZeroRedundancyOptimizer", "ms": 271.0, "x": 1.14, "mib": 265.0},
        {"provider": "zerokern stage 3", "ms": 304.0, "x": 1.28, "mib": 177.0}]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_piped_table_prints_every_header_and_cell_in_full(capsys):
    tables.print_table(ROWS, COLUMNS, "title")
    out = capsys.readouterr().out
    for _, header in COLUMNS:
        assert header in out, (header, out)
    assert "DDP + ZeroRedundancyOptimizer" in out and "…" not in out


@pytest.mark.parametrize("width,rich_expected", [(300, True), (60, False)])
def test_terminal_uses_rich_only_when_the_table_fits(monkeypatch, width, rich_expected):
    pytest.importorskip("rich")
    buf = _Tty()
    monkeypatch.setattr(tables.sys, "stdout", buf)
    monkeypatch.setenv("COLUMNS", str(width))
    tables.print_table(ROWS, COLUMNS)
    out = buf.getvalue()
    assert ("┃" in out) == rich_expected, out
    for _, header in COLUMNS:   # in full either way
        assert header in out, (header, out)
