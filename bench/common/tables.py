"""Markdown tables, as the suites' reports print them."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of `rows` (cells already formatted) under `headers`."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
