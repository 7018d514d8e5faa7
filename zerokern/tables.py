"""Console and markdown tables of result rows (training reports, benchmarks)."""

from __future__ import annotations

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
    """A console table: rich if it is installed, else aligned plain text."""
    cells = format_rows(rows, columns)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
                  for i, (_, h) in enumerate(columns)]
        if title:
            print(title)
        print("  ".join(h.rjust(w) for (_, h), w in zip(columns, widths)))
        print("  ".join("-" * w for w in widths))
        for c in cells:
            print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
        return
    table = Table(title=title or None)
    for _, h in columns:
        table.add_column(h, justify="right")
    for c in cells:
        table.add_row(*c)
    Console().print(table)


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---:" for _ in columns) + "|"
    body = ["| " + " | ".join(c) + " |" for c in format_rows(rows, columns)]
    return "\n".join([head, sep, *body])
