"""Prefix caching's block hashes: which KV a full page of a sequence holds.

A page's KV depends on every token up to its end, on the adapter (its weights change K and V), and,
for isolation, on whose request it is. So block i of a sequence is hashed as

    hash_i = SHA-256(hash_{i-1} || the page's token ids)      hash_{-1} = SHA-256(salt, adapter identity)

truncated to 16 bytes: two sequences share a block only when the salt, the adapter identity and
every token before the block's end are the same. The salt is the tenant's (and a request's own
`cache_salt`, when given), so tenants never share cache entries; the adapter identity is its name,
version and the content hash of its weights (a fresh id when that is unknown), so a re-uploaded
adapter never meets the old one's KV, and the base model has none.
"""

from __future__ import annotations

import hashlib
from array import array

BLOCK_HASH_BYTES = 16


def chain_root(salt: str, adapter_identity: str) -> bytes:
    """hash_{-1}: what every block of a sequence with this salt and adapter chains from."""
    return hashlib.sha256(f"{len(salt)}:{salt}|{adapter_identity}".encode()).digest()[:BLOCK_HASH_BYTES]


def extend_chain(hashes: list[bytes], root: bytes, tokens: list[int], tokens_per_page: int) -> None:
    """Append to `hashes` (a sequence's first blocks' hashes) those of the blocks `tokens` fills: the
    sequence's tokens from the end of its last hashed block on (a last partial block is not hashed)."""
    previous = hashes[-1] if hashes else root
    for start in range(0, len(tokens) - tokens_per_page + 1, tokens_per_page):
        block = array("I", tokens[start : start + tokens_per_page]).tobytes()
        previous = hashlib.sha256(previous + block).digest()[:BLOCK_HASH_BYTES]
        hashes.append(previous)
