"""Structured output in the worker: a grammar matcher per request, and the step's token masks.

A request with `SamplingParams.grammar` gets an llguidance `LLMatcher` before it is added: the state
of its output within the grammar. The worker builds it, and computes its first mask once, on a thread
of `worker/guide_builds.py`, never on the step loop, under llguidance's resource limits
(`loraserve.structured.parser_limits`); the llguidance tokenizer is built at start-up (`prepare`).
Each step that samples guided requests computes their masks (the tokens each grammar allows next)
on a thread of its own while the forward pass runs — the matchers' state only changes in the
engine's update, after the step — and the sampler keeps each guided row to its allowed tokens
(`sampling.TokenMask`). The update then advances each matcher by its sampled token; a grammar that
is complete ends its request.

The masks are packed bits (llguidance's layout: 32 tokens per int32 word, token t at bit t % 32 of
word t // 32), computed on the host for every guided row at once with llguidance's thread pool,
then unpacked to booleans on the step's device. They are filled through `llguidance.numpy` (then
shared with torch, no copy): `llguidance.torch` compiles a kernel at import, which imports
torch._dynamo, 2 s of CPU a worker paid at its first structured request.

A matcher that cannot go on (an invalid grammar, or one that exceeds the limits while it is built, masked
or advanced) ends its own request with INVALID_ARGUMENT naming structured output (`guide_error`), never
the step.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from loraserve.errors import InvalidRequestError
from loraserve.structured import ll_tokenizer, parser_limits
from loraserve.tokenizer import Tokenizer

FIELD = "structured_output"  # what a matcher's failure names


def guide_error(matcher) -> InvalidRequestError:
    """The error a request whose matcher broke down (limits exceeded while masking or advancing) ends with."""
    return InvalidRequestError(FIELD, f"the constraint could not be followed ({_reason(matcher)}); simplify it")


def _reason(matcher) -> str:
    """llguidance's reason a matcher is in error, first line only (the rest is parser state)."""
    return ((matcher.get_error() or "").strip().splitlines() or ["unknown error"])[0]


class GrammarMatchers:
    """Makes matchers for one model's tokenizer (its llguidance tokenizer is built by `prepare`, or on first use)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def prepare(self) -> float:
        """Build the llguidance tokenizer now (seconds taken), so the first structured request does not."""
        started = time.perf_counter()
        self._tokenizer()
        return time.perf_counter() - started

    def matcher(self, grammar: str, generated: list[int]):
        """A matcher for `grammar` that has consumed `generated` (a continued request's earlier tokens),
        within llguidance's resource limits; InvalidRequestError if the grammar is not valid, exceeds the
        limits, or does not allow those tokens. May take long for a costly grammar: never on the step loop."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer(), grammar, limits=parser_limits(), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(FIELD, f"is not a valid constraint: {_reason(matcher)}")
        if generated and not matcher.consume_tokens(generated):
            raise InvalidRequestError("output_ids", f"the grammar does not allow them: {_reason(matcher)}")
        return matcher

    def first_mask(self, matcher) -> None:
        """Compute `matcher`'s next mask once (and drop it): the costly first mask of a grammar (its lexer
        states) is paid here, and a grammar that exceeds the limits doing so fails here (InvalidRequestError)."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        fill_next_token_bitmask(matcher, allocate_token_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            raise guide_error(matcher)

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                tokenizer = self.tokenizer
                self._ll_tokenizer = ll_tokenizer(tokenizer.to_json(), self.vocab_size, list(tokenizer.eos_token_ids))
            return self._ll_tokenizer


class MaskComputer:
    """Computes a step's masks in the background: `start` before the forward pass, `wait` after it."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._executor = None
        self.compute_seconds = 0.0  # cumulative: computing masks (on the mask thread)
        self.wait_seconds = 0.0  # cumulative: the step waiting for its masks after the forward pass
        self.rows = 0  # masks computed

    def start(self, matchers: list) -> concurrent.futures.Future[torch.Tensor]:
        """The packed masks of `matchers` (int32 [len(matchers), ceil(vocab / 32)]), being computed."""
        return self._thread.submit(self._compute, matchers)

    def wait(self, pending: concurrent.futures.Future[torch.Tensor]) -> torch.Tensor:
        """The masks `start` is computing, once ready (the time spent waiting is counted)."""
        started = time.perf_counter()
        bitmask = pending.result()
        self.wait_seconds += time.perf_counter() - started
        return bitmask

    def _compute(self, matchers: list) -> torch.Tensor:
        from llguidance import LLExecutor
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        started = time.perf_counter()
        if self._executor is None:
            self._executor = LLExecutor()
        bitmask = allocate_token_bitmask(len(matchers), self.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        self.compute_seconds += time.perf_counter() - started
        self.rows += len(matchers)
        return torch.from_numpy(bitmask)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def unpack(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Packed masks -> bool [rows, vocab_size] on `device` (True: the token is allowed), unpacked there."""
    packed = bitmask.to(device)
    bits = (packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
