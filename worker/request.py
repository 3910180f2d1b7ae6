"""A generation request as the engine tracks it between steps."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loraserve.prefix_keys import SequenceFingerprints
from loraserve.request_spec import NO_REPLY, RequestSpec
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
    """A request's whole state in the engine: its spec, never changed here (the scheduler's, as the ASSIGN
    carried it, or one made for an offline request, `offline`), whose prompt, sampling parameters, adapter
    key and group the engine reads, and the engine's own state. Owned by the engine: `Engine._update`
    changes its tokens, positions and timestamps; the step scheduler only its status, what it holds in the
    pool, and its KV on preemption (num_computed back to 0)."""

    spec: RequestSpec
    # Its spec's output_ids (tokens an earlier attempt generated), then the tokens generated here.
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
    shared_prefill_tokens: int = 0  # prompt tokens whose KV was copied from a member of its group
    # Prefix caching (`loraserve/prefix_keys.py`): the root of its block-hash chain (None: caching off), the
    # hashes of its full blocks so far, its checkpoint prefixes' fingerprints, how many of its pages are
    # registered, and how many prompt tokens its first admission found cached (reported with the first token).
    chain_root: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    fingerprints: SequenceFingerprints | None = None
    registered_pages: int = 0
    cached_tokens: int = 0
    guide: Any = None  # with sampling.grammar: its llguidance matcher, at the end of output_ids (`worker/grammar.py`)

    @classmethod
    def offline(
        cls,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        adapter: AdapterKey | None = None,
        *,
        output_ids: Sequence[int] = (),
        group: str | None = None,
        cache_salt: str = "",
        **state: Any,
    ) -> Request:
        """A request made in this process (the offline API, benchmarks, tests), with a spec of its own that
        replies to no one (`NO_REPLY`); `state`: the engine's fields of it (seed, guide, ...)."""
        spec = RequestSpec(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            reply_to=NO_REPLY,
            arrival=time.time(),
            adapter=adapter[0] if adapter else None,
            adapter_version=adapter[1] if adapter else 0,
            output_ids=list(output_ids),
            group=group,
            cache_salt=cache_salt,
        )
        return cls(spec, output_ids=list(output_ids), **state)

    @property
    def request_id(self) -> str:
        """Its key in the engine, the pool's page tables and the step's outputs."""
        return self.spec.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        prompt_ids = self.spec.prompt_ids
        prompt = len(prompt_ids)
        if end <= prompt:
            return prompt_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return prompt_ids[start:] + self.output_ids[: end - prompt]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
