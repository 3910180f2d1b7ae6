"""Tables, as the suites' reports print them: Markdown, and rich tables on the console."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def fmt(value: object, spec: str | None = None) -> str:
    """A cell: "–" for None; a number in `spec` (a float by default in 3 significant digits below 1000, whole
    numbers above: 5.47, 0.00422, 1234); anything else as str()."""
    if value is None:
        return "–"
    if spec or isinstance(value, float):
        return format(value, spec or (".3g" if abs(value) < 1000 else ".0f"))
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of `rows` (cells already formatted) under `headers`."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def rich_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[str]) -> Table:
    """A rich table of `rows` (cells already formatted) under `headers`, right-aligned but the `left` ones."""
    from rich.table import Table

    table = Table(title=title)
    for header in headers:
        table.add_column(header, justify="left" if header in left else "right")
    for row in rows:
        table.add_row(*row)
    return table


def wide_console(width: int) -> Console:
    """A console at least `width` columns wide: a narrow terminal or a pipe keeps every column of a table."""
    from rich.console import Console

    return Console(width=max(width, Console().width))
