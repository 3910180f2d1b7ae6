"""A few concurrent streamed generations through the public gRPC API, across the demo adapters.

Used by `loraserve up --show-demo` (and so `make run`), through `loraserve.client`: every stream's
text grows live in one table, then each row shows its latency breakdown from the final summary.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from loraserve.client import ApiError, Chunk, Client, Generation
from loraserve.demo.corpus import HELD_OUT_PROMPTS
from loraserve.demo.styles import STYLES, shows_style


@dataclass
class _Row:
    adapter: str
    prompt: str
    text: str = ""
    summary: Generation | None = None
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _stream(client: Client, row: _Row, max_new_tokens: int) -> None:
    try:
        for event in client.stream(row.prompt, adapter=row.adapter, max_new_tokens=max_new_tokens, timeout=120):
            with row.lock:
                if isinstance(event, Chunk):
                    row.text += event.text
                else:
                    row.summary = event
    except ApiError as e:
        row.error = str(e)


def _table(rows: list[_Row]) -> Table:
    table = Table(title="concurrent streams through the gRPC API", expand=True)
    table.add_column("adapter")
    table.add_column("prompt + streamed continuation", ratio=1, overflow="fold")
    table.add_column("style")
    for column in ("queue", "adapter load", "prefill", "TTFT", "decode"):
        table.add_column(column, justify="right")
    for row in rows:
        s = row.summary
        style = row.adapter or "plain"
        ok = "" if s is None else ("✓ " if shows_style(style, row.text) else "✗ ") + STYLES[style].description
        times = (
            ["", "", "", "", ""]
            if s is None
            else [
                f"{s.timings.queue_s * 1e3:.0f} ms",
                f"{s.timings.adapter_load_s * 1e3:.0f} ms",
                f"{s.timings.prefill_s * 1e3:.0f} ms",
                f"{s.timings.time_to_first_token_s * 1e3:.0f} ms",
                f"{s.timings.decode_s * 1e3:.0f} ms",
            ]
        )
        text = row.error or f"[dim]{row.prompt}[/dim]{row.text}"
        table.add_row(row.adapter or "(base)", text, ok, *times)
    return table


def show_demo(address: str, max_new_tokens: int = 32, **client_options: Any) -> bool:
    """Stream one generation per demo adapter (and the base model) at once; True if all succeeded.

    `client_options` go to `loraserve.client.Client` (api_key, root_certificates, ...)."""
    console = Console()
    if not console.is_terminal:  # piped: a fixed, readable width instead of 80 columns
        console = Console(width=150)
    with Client(address, **client_options) as client:
        adapters = [a.name for a in client.list_adapters()]
        rows = [_Row(name, HELD_OUT_PROMPTS[i % len(HELD_OUT_PROMPTS)]) for i, name in enumerate(["", *adapters])]
        threads = [threading.Thread(target=_stream, args=(client, row, max_new_tokens)) for row in rows]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        with Live(_table(rows), console=console, refresh_per_second=8) as live:
            while any(t.is_alive() for t in threads):
                time.sleep(0.1)
                live.update(_table(rows))
            live.update(_table(rows))
        elapsed = time.perf_counter() - started
    if not console.is_terminal:  # Live leaves a piped output without its final newline
        console.line()
    tokens = sum(r.summary.usage.completion_tokens for r in rows if r.summary)
    finish = {r.summary.finish_reason for r in rows if r.summary}
    console.print(
        f"{len(rows)} streams, {tokens} tokens in {elapsed:.2f} s; finish reasons: {', '.join(sorted(finish))}"
    )
    return all(r.summary is not None for r in rows)
