"""Plain-text tables for command output: columns left-aligned, two spaces apart."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first one usually the header) as aligned lines, without trailing spaces or a
    final newline. ``rows`` must be non-empty and all of the same length."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)
