"""A generation request as the engine tracks it between steps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from loraserve.prefix_keys import SequenceFingerprints
from loraserve.request_spec import RequestSpec
from loraserve.wire import AdapterKey, TokenLogprob  # (name, version): requests keep the version they started with
from loraserve.worker.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_new_tokens or the model's context length
    CANCELLED = "cancelled"  # aborted by the caller (client cancel, deadline)
    ERROR = "error"  # the engine could not serve it (the message says why)


@dataclass
class Request:
    """A request's whole state in the engine. Owned by the engine: `Engine._update` changes its tokens,
    positions and timestamps; the step scheduler only its status, what it holds in the pool, and
    its KV on preemption (num_computed back to 0)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    adapter: AdapterKey | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    seed: int = 0  # each sampled token's draw is keyed by (seed, its position): see sampling.py
    num_preemptions: int = 0
    # Timestamps (monotonic seconds) for latency breakdowns.
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    adapter_wait_s: float = 0.0  # time a step spent waiting for this request's adapter to reach the pool
    # With sampling.logprobs: one per output token. With sampling.prompt_logprobs: one per prompt token
    # after the first, filled chunk by chunk (a recomputation after a preemption writes the same values
    # again) and reported with the first token; None when not asked for, or when the request continues
    # an earlier attempt that reported them.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Requests of one group with the same adapter and prompt compute the prompt once (`StepScheduler`):
    # OpenAI's n choices, or a client's own group.
    group: str | None = None
    shared_prefill_tokens: int = 0  # prompt tokens whose KV was copied from a member of its group
    # Prefix caching (`loraserve/prefix_keys.py`): the root of its block-hash chain (None: caching off), the
    # hashes of its full blocks so far, its checkpoint prefixes' fingerprints, how many of its pages are
    # registered, and how many prompt tokens its first admission found cached (reported with the first token).
    chain_root: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    fingerprints: SequenceFingerprints | None = None
    registered_pages: int = 0
    cached_tokens: int = 0
    # The scheduler's record of it, as the ASSIGN carried it (None for an offline request): never changed here.
    spec: RequestSpec | None = None
    guide: Any = None  # with sampling.grammar: its llguidance matcher, at the end of output_ids (`worker/grammar.py`)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return self.prompt_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
