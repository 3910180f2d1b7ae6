"""The versions the store holds in host RAM, and the memory budget they count against.

A plain object: no locks (the store's lock guards it), no clock (callers pass `now`), no I/O. It
owns, per name, the current version and the high-water mark (which survives deletes: versions
are never reused), and per held (name, version) its record, files and rows. A superseded or
deleted version is *retired*: it stays held, and counted against the budget, until `purge` finds
its retention over. Versions that leave the table are returned to the caller, which releases
their rows (their shared-memory files) outside the table.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from loraserve.adapter_store.config import MIB, StoreLimits
from loraserve.adapter_store.files import AdapterFiles
from loraserve.adapter_store.packing import PackedRows
from loraserve.adapter_store.validation import AdapterRecord
from loraserve.errors import AdapterNotFoundError, NotFoundError, ResourceExhaustedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreStats:
    adapters: int  # names registered now
    held_versions: int  # versions held, retired ones included
    retired_versions: int
    used_bytes: int  # files and rows of every held version
    retired_bytes: int
    budget_bytes: int
    max_adapter_bytes: int


@dataclass
class Held:
    """One version in RAM: what the store tells about it, its files, and its rows when the store makes them."""

    record: AdapterRecord
    files: AdapterFiles
    retired_at: float | None = None  # when it was superseded or deleted
    rows: PackedRows | None = None  # the weights in the pool's row layout (`packing.py`), with a RowsMaker

    @property
    def nbytes(self) -> int:
        """Host RAM it holds: its files, and its rows (in RAM or in shared memory, which is RAM too)."""
        return len(self.files.config_json) + len(self.files.weights) + rows_bytes(self.rows)


def rows_bytes(rows: PackedRows | None) -> int:
    return rows.spec.nbytes if rows is not None else 0


class VersionTable:
    """Names, their current and retired versions, the high-water marks and the bytes in use."""

    def __init__(self, limits: StoreLimits):
        self.limits = limits
        self._held: dict[tuple[str, int], Held] = {}
        self._current: dict[str, int] = {}  # name -> current version
        self._last_version: dict[str, int] = {}  # survives deletes: versions are never reused
        self._retired: deque[tuple[float, tuple[str, int]]] = deque()  # (retired at, key), oldest first
        self.used = 0  # bytes of every held version

    # ---- changes -------------------------------------------------------------------------------
    def next_version(self, name: str) -> int:
        """Give out `name`'s next version number; it is used up even if the version is never added."""
        version = self._last_version.get(name, 0) + 1
        self._last_version[name] = version
        return version

    def raise_last_versions(self, last: dict[str, int]) -> None:
        """Make sure no version up to `last[name]` is given out again (the storage's high-water marks)."""
        for name, version in last.items():
            self._last_version[name] = max(version, self._last_version.get(name, 0))

    def add(self, held: Held, now: float) -> list[Held]:
        """Serve `held` as its name's current version; the previous one retires. Returns what left the table:
        a version held under the same number before, and what `purge` dropped."""
        name, version = held.record.name, held.record.version
        gone = []
        replaced = self._held.get((name, version))
        if replaced is not None:
            self.used -= replaced.nbytes
            gone.append(replaced)
        self._held[(name, version)] = held
        self.used += held.nbytes
        previous = self._current.get(name)
        if previous is not None:
            self._retire(name, previous, now)
        self._current[name] = version
        self._last_version[name] = max(version, self._last_version.get(name, 0))
        return gone + self.purge(now)  # a zero retention drops the superseded version at once

    def remove(self, name: str, now: float) -> tuple[int, list[Held]]:
        """Unregister `name`: its current version retires. Returns that version and what `purge` dropped."""
        version = self.current_version(name)
        del self._current[name]
        self._retire(name, version, now)
        return version, self.purge(now)

    def purge(self, now: float) -> list[Held]:
        """Drop the retired versions whose retention is over: O(expired), as retirements are queued in time order."""
        purged = []
        while self._retired and now - self._retired[0][0] >= self.limits.retention_s:
            _, key = self._retired.popleft()
            held = self._held.pop(key)
            self.used -= held.nbytes
            purged.append(held)
            log.info("purged adapter %s v%d (retention over)", *key)
        return purged

    def _retire(self, name: str, version: int, now: float) -> None:
        self._held[(name, version)].retired_at = now
        self._retired.append((now, (name, version)))

    # ---- reading -------------------------------------------------------------------------------
    def current_version(self, name: str) -> int:
        """`name`'s current version; AdapterNotFoundError (listing the names) when it has none."""
        version = self._current.get(name)
        if version is None:
            raise AdapterNotFoundError(name, list(self._current))
        return version

    def current_version_or_none(self, name: str) -> int | None:
        return self._current.get(name)

    def current_record(self, name: str) -> AdapterRecord:
        """The record of `name`'s current version; AdapterNotFoundError (listing the names) when it has none."""
        return self._held[(name, self.current_version(name))].record

    def current(self, name: str) -> Held | None:
        """`name`'s current version, None when it has none."""
        version = self._current.get(name)
        return self._held.get((name, version)) if version is not None else None

    def get(self, name: str, version: int) -> Held | None:
        """One held version, current or retired; None when not held."""
        return self._held.get((name, version))

    def not_held(self, name: str, version: int) -> NotFoundError:
        """The precise error for a version that is not held: never registered, deleted, or released."""
        current, last = self._current.get(name), self._last_version.get(name)
        if last is None:
            return AdapterNotFoundError(name)
        why = f"adapter {name!r} was deleted" if current is None else f"adapter {name!r} is at version {current}"
        if 1 <= version <= last:
            why += f" and version {version} was released (retired versions are kept {self.limits.retention_s:g} s)"
        else:
            why += f"; version {version} never existed"
        return NotFoundError(why)

    def records(self) -> list[AdapterRecord]:
        """The current version of every adapter, sorted by name."""
        return [self._held[(name, self._current[name])].record for name in sorted(self._current)]

    def check_fits(self, nbytes: int) -> None:
        """Raise ResourceExhaustedError if `nbytes` more would exceed the memory budget."""
        budget = self.limits.budget_bytes
        if self.used + nbytes <= budget:
            return
        retired = self._retired_held()
        retired_bytes = sum(h.nbytes for h in retired)
        raise ResourceExhaustedError(
            f"host-RAM budget exhausted: the adapter needs {nbytes / MIB:.1f} MiB but {self.used / MIB:.1f} of "
            f"{budget / MIB:.1f} MiB are in use ({retired_bytes / MIB:.1f} MiB by {len(retired)} superseded or "
            f"deleted version(s) kept up to {self.limits.retention_s:g} s for requests in flight); "
            "delete adapters or raise the store's memory budget"
        )

    def stats(self) -> StoreStats:
        retired = self._retired_held()
        return StoreStats(
            adapters=len(self._current),
            held_versions=len(self._held),
            retired_versions=len(retired),
            used_bytes=self.used,
            retired_bytes=sum(h.nbytes for h in retired),
            budget_bytes=self.limits.budget_bytes,
            max_adapter_bytes=self.limits.max_adapter_bytes,
        )

    def _retired_held(self) -> list[Held]:
        return [h for h in self._held.values() if h.retired_at is not None]
