"""Dispatch by type: one table from a message (or decision) class to the method that handles it.

Every loop that receives several kinds of messages — the worker's scheduler inbox, the gateway's
token sink, the scheduler's decisions — routes them through a `Dispatcher` instead of a chain of
`isinstance` tests, so the set of kinds a loop handles is written in one place and an unexpected
kind is reported the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Dispatcher:
    """Calls the handler registered for the exact type of what it is given."""

    def __init__(self, handlers: dict[type, Callable[[Any], object]]) -> None:
        self._handlers = dict(handlers)

    def handles(self, item: object) -> bool:
        return type(item) in self._handlers

    def __call__(self, item: object) -> bool:
        """Handle `item`; False (and nothing done) when no handler takes its type."""
        handler = self._handlers.get(type(item))
        if handler is None:
            return False
        handler(item)
        return True
