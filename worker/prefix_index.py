"""Which KV pages hold which block of tokens: the prefix cache's index (pure bookkeeping, no tensors).

`PagePool` (page_pool.py) owns the pages and counts who holds each; this index remembers, for each
full page whose KV is known to hold a given block of tokens (its block hash: `loraserve/prefix_keys.py`),
the page of that block, and keeps the registered pages no sequence holds any more — *idle* cached
pages — in least-recently-released order, so the pool can reclaim the oldest first. Pages that end a
checkpoint prefix also carry its fingerprint, which the worker reports to the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    """Block hash ↔ page for registered KV pages, idle ones in release order, and their fingerprints."""

    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}  # block hash -> the page holding that block's KV
        self._hash_of: dict[int, bytes] = {}  # registered page -> its block hash
        self._idle: OrderedDict[int, None] = OrderedDict()  # idle registered pages, released longest ago first
        # registered pages that end a checkpoint prefix -> its fingerprint, least recently used first
        self._fingerprint_of: OrderedDict[int, bytes] = OrderedDict()
        self.epoch = 0  # counts changes to the set of fingerprints (the worker reports them when it moves)
        self.evictions = 0  # idle cached pages reclaimed for other use

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The pages holding the longest run of leading blocks among `hashes` (a prefix's block hashes)."""
        pages = []
        for block in hashes:
            page = self._page_of.get(block)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, page: int, block: bytes, fingerprint: bytes | None) -> None:
        """`page` holds the KV of the block hashed `block`; a block or page already registered is kept."""
        if block in self._page_of or page in self._hash_of:
            return
        self._page_of[block] = page
        self._hash_of[page] = block
        if fingerprint is not None:
            self._fingerprint_of[page] = fingerprint
            self.epoch += 1

    def release(self, page: int) -> bool:
        """No sequence holds `page` any more: True if it stays cached (idle), False if it is free."""
        if page not in self._hash_of:
            return False
        self._idle[page] = None
        return True

    def claim(self, page: int) -> None:
        """A sequence attaches `page`: it is no longer idle, and its prefix was just used."""
        self._idle.pop(page, None)
        if page in self._fingerprint_of:
            self._fingerprint_of.move_to_end(page)

    def reclaim_oldest(self) -> int:
        """Forget the idle page released longest ago and hand it back for other use."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        if self._fingerprint_of.pop(page, None) is not None:
            self.epoch += 1
        self.evictions += 1
        return page

    def idle_pages(self) -> list[int]:
        return list(self._idle)

    def idle_count(self) -> int:
        return len(self._idle)

    def registered_count(self) -> int:
        """Registered pages, held or idle."""
        return len(self._hash_of)

    def fingerprints(self, limit: int) -> list[bytes]:
        """Fingerprints of the checkpoint prefixes whose last page is cached, most recently used first."""
        recent = reversed(self._fingerprint_of.values())
        return [fp for fp, _ in zip(recent, range(limit), strict=False)]

    def check_invariants(self) -> None:
        if any(self._page_of[h] != p for p, h in self._hash_of.items()) or len(self._page_of) != len(self._hash_of):
            raise AssertionError("block hashes and their pages disagree")
        if any(p not in self._hash_of for p in (*self._idle, *self._fingerprint_of)):
            raise AssertionError("an idle cached or fingerprinted page has no block hash")
