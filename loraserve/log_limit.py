"""Rate-limited warnings, for messages a peer can make us log as often as it likes.

A role drops a malformed or unexpected message with a warning. A peer that floods the socket
with such messages must not flood the log too (filling disks, hiding everything else), so each
(peer, kind) pair may log `burst` lines per `period_s`; later ones in the period are counted and
summed up in one line when the next period opens. The table of pairs is bounded (`max_keys`,
oldest forgotten first), so a flood from ever-new peer identities cannot grow memory either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Window:
    opened: float
    logged: int = 0
    suppressed: int = 0


class RateLimitedLog:
    """`warning(peer, kind, msg, *args)` logs through `logger` at most `burst` times per period per pair."""

    def __init__(
        self,
        logger: logging.Logger,
        period_s: float = 10.0,
        burst: int = 5,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ):
        if period_s <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("period_s must be positive, burst and max_keys at least 1")
        self.logger, self.period_s, self.burst, self.max_keys, self.clock = logger, period_s, burst, max_keys, clock
        self._windows: OrderedDict[tuple[str, str], _Window] = OrderedDict()
        self._lock = threading.Lock()  # the data plane and the worker's fetch threads log from threads

    def warning(self, peer: object, kind: str, msg: str, *args: object) -> bool:
        """Log `msg % args` (prefixed by the peer) unless this pair used up its burst; True if logged."""
        key = (_short(peer), kind)
        with self._lock:
            window, suppressed = self._window(key)
            allowed = window.logged < self.burst
            if allowed:
                window.logged += 1
            else:
                window.suppressed += 1
        if suppressed:
            self.logger.warning("%s from %s: %d similar messages were not logged", kind, key[0], suppressed)
        if allowed:
            self.logger.warning("%s from %s: %s", kind, key[0], msg % args if args else msg)
        return allowed

    def _window(self, key: tuple[str, str]) -> tuple[_Window, int]:
        """The pair's current window (a fresh one when the period is over) and what the old one suppressed."""
        now = self.clock()
        window = self._windows.get(key)
        suppressed = 0
        if window is None or now - window.opened >= self.period_s:
            suppressed = window.suppressed if window is not None else 0
            window = self._windows[key] = _Window(now)
        self._windows.move_to_end(key)
        while len(self._windows) > self.max_keys:
            self._windows.popitem(last=False)
        return window, suppressed


def _short(peer: object) -> str:
    """A peer's identity fit for a log line: bounded, and bytes shown as repr (they may be binary)."""
    text = peer if isinstance(peer, str) else repr(peer)
    return text[:64]
