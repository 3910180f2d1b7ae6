"""The gateway's cache of every adapter's current version, kept current by the store.

A generation names an adapter; the worker needs the exact (name, version) and the weights' hash.
Instead of asking the store per request, the gateway watches it (`AdapterStore.Watch`: every
current version, then each change) and resolves names from this cache. A name the cache does not
hold is asked of the store (it may have been registered a moment ago through another gateway).
While the watch is down (the store restarting) the cache keeps serving what it knew — nothing can
change in a store that is down — and when the watch is back, its snapshot replaces the whole
cache at once, so names deleted meanwhile disappear. A registration or delete made through this
gateway updates the cache at once, so a client reads its own writes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from loraserve.v1 import adapter_store_pb2, common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterVersion:
    """The adapter version a request was resolved to at arrival (version 0: the base model)."""

    version: int = 0
    sha256: str = ""  # of its weights file: workers check their cached copy against it
    rank: int = 0  # LoRA rank (0: the base model, or not known): the scheduler weighs requests by it


class AdapterVersions:
    """name -> current AdapterVersion, as the store last said (see the module docstring)."""

    def __init__(self) -> None:
        self._current: dict[str, AdapterVersion] = {}
        self._snapshot: dict[str, AdapterVersion] | None = {}  # being received; None once synced
        self.synced = False  # a snapshot has been received at least once

    def get(self, name: str) -> AdapterVersion | None:
        """The cached version, or None: ask the store."""
        return self._current.get(name) if self.synced else None

    def apply(self, change: adapter_store_pb2.AdapterChange) -> None:
        target = self._current if self._snapshot is None else self._snapshot
        if change.synced:
            self._current, self._snapshot, self.synced = self._snapshot or {}, None, True
        elif change.deleted:
            target.pop(change.name, None)
        else:
            target[change.name] = AdapterVersion(change.version, change.sha256, change.rank)

    def learned(self, info: common_pb2.AdapterInfo) -> None:
        """A registration answered through this gateway: the new version, before the watch says so."""
        known = self._current.get(info.name)
        if known is None or known.version <= info.version:
            self._current[info.name] = AdapterVersion(info.version, info.sha256, info.rank)

    def forget(self, name: str) -> None:
        self._current.pop(name, None)

    def resubscribe(self) -> None:
        """The watch broke: keep serving what is known; the next snapshot replaces it whole."""
        self._snapshot = {}

    def __len__(self) -> int:
        return len(self._current)


async def watch_store(store, versions: AdapterVersions, retry_s: float = 0.5) -> None:
    """Keep `versions` current from the store's Watch stream, reconnecting whenever it breaks."""
    while True:
        try:
            async for change in store.Watch(adapter_store_pb2.WatchAdaptersRequest()):
                versions.apply(change)
                if change.synced:
                    log.info("adapter versions: watching the store (%d adapters)", len(versions))
        except grpc.aio.AioRpcError as e:
            if versions.synced:
                log.warning("adapter versions: lost the store's watch (%s); serving what is known", e.code().name)
        versions.resubscribe()
        await asyncio.sleep(retry_s)
