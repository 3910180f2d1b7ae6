"""No `asyncio.wait_for` in the shipped code: on Python 3.11 it swallows a cancellation that lands
as the awaited thing completes (it returns the result instead of raising CancelledError), so a
client that leaves while a token arrives would have its generation run to the end. `asyncio.timeout`
propagates the cancellation; the gateway's reader test (test_gateway_failover.py) shows the race."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["loraserve", "gateway", "scheduler", "adapter_store", "worker", "launcher", "kernels", "bench", "demo"]


def test_no_shipped_code_calls_asyncio_wait_for():
    calls = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for folder in SHIPPED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "wait_for"
    ]
    assert not calls, f"asyncio.wait_for swallows cancellations on 3.11; use `async with asyncio.timeout(...)`: {calls}"
