"""The emulated runner's "model": next-token logits that are a pure function of the sequence, no weights.

For a sequence of `length` tokens ending in `last` under an adapter (or the base model), the logits
depend only on a 64-bit digest of (the adapter's identity, length, last): so they are a function of
the sequence's token ids, like a model's, and a request continued on another worker after a
failover (prompt + the tokens already generated, recomputed) gets exactly the tokens it would
have got, greedy or seeded. Only the last token and the length go in because a prefill chunk that
scores its prompt sees only its own tokens, and its logits must not depend on where the chunks fall.

    logits[v] = noise[(v + digest) mod vocab]     a fixed random vector in [0, 1), rotated by the digest
    logits[c_j] = TOP_LOGIT - j · CANDIDATE_STEP   for CANDIDATES distinct ordinary tokens c_j the digest picks
    logits[s] = SPECIAL_LOGIT                       for special tokens (EOS, BOS, <unk>, ids past the tokenizer's)

So greedy decoding gives c_0 and sampling mostly the candidates; an EOS is never chosen unless a
grammar allows nothing else (its logit is finite: a mask can still choose it), so a request ends by
its length limit, its stop strings or its grammar. A grammar that rules the candidates out gets
the allowed token the rotated noise ranks first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from loraserve.errors import InvalidModelError
from loraserve.worker.sampling import draw_seed

TOP_LOGIT = 20.0
CANDIDATE_STEP = 1.5  # the first candidate then has about 3/4 of the probability at temperature 1
CANDIDATES = 8
SPECIAL_LOGIT = -1.0e4  # finite: never drawn (exp underflows to 0), still a choice under a mask
NOISE_SEED = 0  # the same noise in every worker process


def adapter_seed(identity: str) -> int:
    """A 64-bit number for an adapter's identity ("" for the base model)."""
    return int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "little")


class PseudoModel:
    """Deterministic next-token logits over `vocab_size` ids (see the module docstring)."""

    def __init__(self, vocab_size: int, special_ids: Iterable[int]):
        special = sorted({i for i in special_ids if 0 <= i < vocab_size})
        self.ordinary = sorted(set(range(vocab_size)) - set(special))
        if not self.ordinary:
            raise InvalidModelError("the tokenizer marks every token id special: the emulated runner has none to emit")
        self.vocab_size = vocab_size
        self.noise = torch.rand(vocab_size, generator=torch.Generator().manual_seed(NOISE_SEED))
        self.special = torch.tensor(special, dtype=torch.long)
        self.k = min(CANDIDATES, len(self.ordinary))
        self.stride = max(1, len(self.ordinary) // self.k)  # k · stride <= len: the candidates are distinct
        self.candidate_logits = TOP_LOGIT - CANDIDATE_STEP * torch.arange(self.k, dtype=torch.float32)
        self.positions = torch.arange(vocab_size)

    @staticmethod
    def digest(adapter: int, length: int, last: int) -> int:
        """The digest of a sequence of `length` tokens ending in `last` under `adapter` (`adapter_seed`)."""
        return draw_seed(draw_seed(adapter, length), last)

    def greedy(self, digest: int) -> int:
        """The most likely token: the first candidate (what argmax of `logits` gives, without building them)."""
        return self.ordinary[digest % len(self.ordinary)]

    def candidates(self, digest: int) -> list[int]:
        n = len(self.ordinary)
        return [self.ordinary[(digest + j * self.stride) % n] for j in range(self.k)]

    def logits(self, digests: list[int]) -> torch.Tensor:
        """float32 [len(digests), vocab]: each digest's logits."""
        shifts = torch.tensor([d % self.vocab_size for d in digests], dtype=torch.long)
        out = self.noise[(self.positions[None, :] + shifts[:, None]) % self.vocab_size]
        if len(self.special):
            out[:, self.special] = SPECIAL_LOGIT
        chosen = torch.tensor([self.candidates(d) for d in digests], dtype=torch.long).reshape(len(digests), self.k)
        out.scatter_(1, chosen, self.candidate_logits.expand(len(digests), self.k))
        return out
