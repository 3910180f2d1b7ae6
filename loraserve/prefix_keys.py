"""Prefix caching's keys: which KV a full page of a sequence holds, and where a prefix is cached.

A page's KV depends on every token up to its end, on the adapter (its weights change K and V), and,
for isolation, on whose request it is. So block i of a sequence is hashed as

    hash_i = SHA-256(hash_{i-1} || the page's token ids)      hash_{-1} = SHA-256(salt, adapter identity)

truncated to 16 bytes: two sequences share a block only when the salt, the adapter identity and
every token before the block's end are the same. The salt is the tenant's (and a request's own
`cache_salt`, when given), so tenants never share cache entries; the adapter identity is its name,
version and the content hash of its weights (a fresh id when that is unknown), so a re-uploaded
adapter never meets the old one's KV, and the base model has none. Workers key their pages by
these hashes (`worker/page_pool.py`).

The scheduler places a request where its prefix is cached. Workers cannot report every block hash
(a GPU's pool holds tens of thousands), and the scheduler cannot afford to hash every block of every
prompt, so both use *fingerprints* of a few prefix lengths only — `CHECKPOINTS`, 1, 2, 3, 4, 6, 8,
12, 16, ... blocks (powers of two and 1.5 times them):

    fingerprint(n blocks) = SHA-256("fp" || hash_{-1} || the first n pages' token ids)

A worker reports the fingerprints of the checkpoint pages it holds; the scheduler computes a
prompt's few fingerprints in one pass over its bytes (`PrefixProbe`) and reads off, per worker, the
longest checkpoint cached there: at least two thirds of the cached prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BLOCK_HASH_BYTES = 16
FINGERPRINT_BYTES = 16


def chain_root(salt: str, adapter_identity: str) -> bytes:
    """hash_{-1}: what every block of a sequence with this salt and adapter chains from."""
    return hashlib.sha256(f"{len(salt)}:{salt}|{adapter_identity}".encode()).digest()[:BLOCK_HASH_BYTES]


def adapter_identity(name: str, version: int, sha256: str) -> str:
    """What a cached KV block's adapter is: its name, version and weights' hash ("" for the base model)."""
    return f"{name}\0{version}\0{sha256}"


def extend_chain(hashes: list[bytes], root: bytes, tokens: list[int], tokens_per_page: int) -> None:
    """Append to `hashes` (a sequence's first blocks' hashes) those of the blocks `tokens` fills: the
    sequence's tokens from the end of its last hashed block on (a last partial block is not hashed)."""
    previous = hashes[-1] if hashes else root
    for start in range(0, len(tokens) - tokens_per_page + 1, tokens_per_page):
        block = array("I", tokens[start : start + tokens_per_page]).tobytes()
        previous = hashlib.sha256(previous + block).digest()[:BLOCK_HASH_BYTES]
        hashes.append(previous)


def is_checkpoint(blocks: int) -> bool:
    """Whether a prefix of `blocks` full pages has a fingerprint: 1, 2, 3, 4, 6, 8, 12, 16, 24, ..."""
    if blocks < 1:
        return False
    odd = blocks >> ((blocks & -blocks).bit_length() - 1)  # blocks without its factors of two
    return odd in (1, 3)


def checkpoints(blocks: int) -> list[int]:
    """The checkpoints up to `blocks`, in increasing order."""
    out, power = [], 1
    while power <= blocks:
        out.append(power)
        if power >= 2 and power * 3 // 2 <= blocks:
            out.append(power * 3 // 2)
        power *= 2
    return sorted(out)


class SequenceFingerprints:
    """A growing sequence's checkpoint fingerprints, each computed once, in one pass over its tokens
    (a worker's request: its pages fill in order; after a preemption it asks again for ones it knows)."""

    __slots__ = ("_blocks", "_hasher", "known")

    def __init__(self, root: bytes):
        self._hasher = _fingerprint_hasher(root)
        self._blocks = 0  # pages hashed so far
        self.known: dict[int, bytes] = {}  # checkpoint (pages) -> fingerprint

    def at(self, blocks: int, tokens: Callable[[int, int], list[int]], tokens_per_page: int) -> bytes:
        """The fingerprint of the first `blocks` pages (a checkpoint); `tokens(start, end)` reads the
        sequence's tokens."""
        known = self.known.get(blocks)
        if known is not None:
            return known
        if blocks < self._blocks:
            raise ValueError(f"checkpoint {blocks} is behind the {self._blocks} pages hashed")
        self._hasher.update(array("I", tokens(self._blocks * tokens_per_page, blocks * tokens_per_page)).tobytes())
        self._blocks = blocks
        known = self.known[blocks] = self._hasher.copy().digest()[:FINGERPRINT_BYTES]
        return known


def _fingerprint_hasher(root: bytes):
    hasher = hashlib.sha256(b"fp")
    hasher.update(root)
    return hasher


class PrefixProbe:
    """A queued request's prefix as placement asks about it: its fingerprints at every checkpoint its
    tokens fill (never counting the last token, which is always computed), computed on first use for
    a page size and kept."""

    __slots__ = ("_fingerprints", "_root", "_tokens")

    def __init__(self, root: bytes, tokens: Sequence[int]):
        self._root = root
        self._tokens = tokens  # prompt (+ tokens already generated), converted only when asked
        self._fingerprints: dict[int, tuple[tuple[int, bytes], ...]] = {}

    def fingerprints(self, tokens_per_page: int) -> tuple[tuple[int, bytes], ...]:
        """(tokens covered, fingerprint) for each checkpoint, longest first."""
        known = self._fingerprints.get(tokens_per_page)
        if known is None:
            known = self._fingerprints[tokens_per_page] = self._compute(tokens_per_page)
        return known

    def _compute(self, tokens_per_page: int) -> tuple[tuple[int, bytes], ...]:
        blocks = (len(self._tokens) - 1) // tokens_per_page
        if blocks < 1:
            return ()
        data = array("I", self._tokens[: blocks * tokens_per_page]).tobytes()
        page_bytes = 4 * tokens_per_page
        hasher, done, out = _fingerprint_hasher(self._root), 0, []
        for n in checkpoints(blocks):
            hasher.update(data[done * page_bytes : n * page_bytes])
            done = n
            out.append((n * tokens_per_page, hasher.copy().digest()[:FINGERPRINT_BYTES]))
        return tuple(reversed(out))

    def cached_tokens(self, tokens_per_page: int, cached: frozenset[bytes] | set[bytes]) -> int:
        """Tokens of the longest checkpoint prefix among `cached` fingerprints (0: none)."""
        if not cached:
            return 0
        return next((n for n, fp in self.fingerprints(tokens_per_page) if fp in cached), 0)
