"""What a generation yields, as plain values: `Chunk`s of text and tokens as they come, then one `Summary`.

The generation core (`gateway/core.py`) produces them; each edge writes them in its own shape (the
gRPC API's `GenerateStreamResponse`, the HTTP API's OpenAI chunks). A failure is raised, not yielded:
a `LoraserveError` whose `status` each edge maps to its own (gRPC status, HTTP code).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from loraserve.errors import ResourceExhaustedError


class TopLogprob(NamedTuple):
    """One of the most likely tokens at a position."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability (None: a prompt's first token, which nothing predicts) and the most
    likely tokens at its position, most likely first."""

    token_id: int
    logprob: float | None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """Text and tokens produced since the previous chunk; the prompt's log-probabilities come with the
    first. Every chunk carries the prompt's token count and how many of them were found cached (what a
    running usage reports)."""

    text: str
    token_ids: Sequence[int] = ()
    logprobs: Sequence[Logprob] = ()
    prompt_logprobs: Sequence[Logprob] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @staticmethod
    def joined(chunks: list[Chunk]) -> Chunk:
        """Consecutive chunks as one (the counts: the last one's)."""
        if len(chunks) == 1:
            return chunks[0]
        last = chunks[-1]
        return Chunk(
            "".join(c.text for c in chunks),
            [t for c in chunks for t in c.token_ids],
            [e for c in chunks for e in c.logprobs],
            [e for c in chunks for e in c.prompt_logprobs],
            last.prompt_tokens,
            last.cached_tokens,
        )


@dataclass(frozen=True)
class Timings:
    """Where a generation's time went, in seconds."""

    queue_s: float = 0.0
    adapter_load_s: float = 0.0
    prefill_s: float = 0.0
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True)
class Summary:
    """How a generation ended: the last event. `finish_reason`: "stop", "length", "stop_sequence", or
    another reason a worker gave (which the edges report as unspecified)."""

    request_id: str
    client_request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    timings: Timings = field(default_factory=Timings)
    adapter_version: int = 0
    worker_id: str = ""
    failovers: int = 0


Event = Chunk | Summary


class RetryLaterError(ResourceExhaustedError):
    """RESOURCE_EXHAUSTED with a hint of when to retry (a quota's refusal): the gRPC edge sends it as
    the trailing metadata `retry-after-ms`, the HTTP edge as a Retry-After header."""

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


def logprobs_of(token_ids: Sequence[int], entries: Sequence[tuple]) -> list[Logprob]:
    """One Logprob per token of `token_ids`, from the worker's entries for them, each (logprob, top
    ids, top logprobs); none when none were asked for."""
    if not entries:
        return []
    return [
        Logprob(token_id, logprob, tuple(map(TopLogprob, ids, values)))
        for token_id, (logprob, ids, values) in zip(token_ids, entries, strict=True)
    ]


def prompt_logprobs_of(prompt_ids: Sequence[int], entries: Sequence[tuple]) -> list[Logprob]:
    """One Logprob per prompt token: the first has no log-probability, the others the worker's entries."""
    first = [Logprob(prompt_ids[0], None)] if prompt_ids else []
    return first + logprobs_of(prompt_ids[1:], entries)
