"""Console and markdown tables of result rows (training reports, benchmarks)."""

from __future__ import annotations

import sys
from typing import List, Sequence, Tuple

Column = Tuple[str, str]  # (row key, header)


def fmt_value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3g}" if abs(v) < 0.1 else f"{v:.2f}"
    return str(v)


def format_rows(rows: Sequence[dict], columns: Sequence[Column]) -> List[List[str]]:
    return [[fmt_value(r.get(key)) for key, _ in columns] for r in rows]


def print_table(rows: Sequence[dict], columns: Sequence[Column], title: str = "") -> None:
    """A console table: rich on a terminal wide enough for it, else aligned plain text.

    [Note: tables in logs] Piped to a file or a CI log, rich lays the table out for 80 columns
    and cuts headers to "zero…" / "prov…" (issue 25), so a log would not say what a column is.
    Off a terminal, and on a terminal narrower than the table, the plain layout prints every
    header and cell in full (a long line is better than a lost header).
    """
    cells = format_rows(rows, columns)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, (_, h) in enumerate(columns)]
    table_width = sum(widths) + 3 * len(widths) + 1   # rich's borders and padding
    console = _rich_console(table_width)
    if console is None:
        if title:
            print(title)
        print("  ".join(h.rjust(w) for (_, h), w in zip(columns, widths)))
        print("  ".join("-" * w for w in widths))
        for c in cells:
            print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
        return
    from rich.table import Table

    table = Table(title=title or None)
    for _, h in columns:
        table.add_column(h, justify="right", no_wrap=True)
    for c in cells:
        table.add_row(*c)
    console.print(table)


def _rich_console(table_width: int):
    """A rich Console when stdout is a terminal at least `table_width` wide, else None."""
    if not sys.stdout.isatty():
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    console = Console()
    return console if console.width >= table_width else None


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---:" for _ in columns) + "|"
    body = ["| " + " | ".join(c) + " |" for c in format_rows(rows, columns)]
    return "\n".join([head, sep, *body])
