"""Markdown tables with aligned columns, for the reports (the lab's copy of attnflow's)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown_table"]


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Return a GitHub-flavoured Markdown table, each column padded to its widest cell.

    Parameters
    ----------
    header : sequence of str
        The column titles.
    body : sequence of sequence of str
        The rows, each with one cell per column.

    Returns
    -------
    str
        The header line, the rule and one line per row, joined by newlines.

    Examples
    --------
    >>> print(markdown_table(["method", "L1"], [["flow", "0.50"]]))
    | method | L1   |
    |--------|------|
    | flow   | 0.50 |
    """
    rows = [list(header), *(list(row) for row in body)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(rows[0]), rule, *(line(row) for row in rows[1:])])
