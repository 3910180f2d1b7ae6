"""One request, as the scheduler accepted it: an immutable record built once and read everywhere after.

The scheduler's Submit servicer turns the gateway's SubmitRequest into a `RequestSpec` (`scheduler/submit.py`);
the spec waits in the scheduler's queue, travels unchanged inside the ASSIGN (`loraserve/wire.py`),
and the worker's `Request` holds it as received. Nothing changes it on the way: a failover builds a
new spec from the gateway's new Submit.

Its types are its wire schema (msgspec over msgpack): every bound is an annotation, unknown fields
are refused, and `__post_init__` checks what crosses fields (the reply address, the token total,
the sampling values), so a decoded spec is a valid one.
"""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec

from loraserve.endpoints import BadEndpointError, check_endpoint
from loraserve.params import MAX_LOGPROBS, SamplingParams, check_sampling
from loraserve.structured import MAX_GRAMMAR_BYTES

MAX_ID = 256  # request ids, worker ids, adapter names
MAX_TEXT = 64 * 1024  # characters of an error message or reason
MAX_LIST = 1 << 20  # tokens of one request (prompt + output): a 1M-token prompt
MAX_STOP_TOKENS = 1024
MAX_ADAPTER_RANK = 4096  # far above any rank a store admits (its --max-lora-rank)

Id = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
Short = Annotated[str, msgspec.Meta(max_length=64)]  # hashes, tenants, instance ids
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
Version = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]  # uint32 in the protos
# Finite, any sign (clocks of two hosts may disagree a little): NaN and infinities fail both bounds.
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
Seconds = Finite
TokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_LIST)]
Endpoint = Annotated[str, msgspec.Meta(max_length=1024)]  # tcp:// or ipc://, checked by `check_endpoint`


_DEFAULT = SamplingParams()  # the one place sampling defaults are written


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request's sampling parameters as the scheduler accepted them: `SamplingParams`' fields, defaults
    and checks (`loraserve/params.py`), in the spec's wire form. The worker's engine reads `params()`."""

    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = _DEFAULT.max_new_tokens
    temperature: Finite = _DEFAULT.temperature
    top_k: Count = _DEFAULT.top_k
    top_p: Finite = _DEFAULT.top_p
    min_p: Finite = _DEFAULT.min_p
    seed: Count | None = _DEFAULT.seed
    repetition_penalty: Finite = _DEFAULT.repetition_penalty
    presence_penalty: Finite = _DEFAULT.presence_penalty
    frequency_penalty: Finite = _DEFAULT.frequency_penalty
    stop_token_ids: Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=MAX_STOP_TOKENS)] = _DEFAULT.stop_token_ids
    ignore_eos: bool = _DEFAULT.ignore_eos
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = _DEFAULT.logprobs
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = _DEFAULT.prompt_logprobs
    grammar: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_BYTES)] | None = _DEFAULT.grammar

    def __post_init__(self) -> None:
        check_sampling(self)  # InvalidRequestError naming the field: the scheduler answers INVALID_ARGUMENT

    def params(self) -> SamplingParams:
        """The engine's form of the same values (the one conversion after the scheduler's edge)."""
        return SamplingParams(**{name: getattr(self, name) for name in self.__struct_fields__})


class RequestSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything about one request that is fixed once the scheduler accepted it."""

    request_id: Id
    prompt_ids: TokenIds
    sampling: Sampling
    reply_to: Endpoint  # the gateway's token sink
    arrival: Seconds  # unix seconds at the gateway
    adapter: Id | None = None  # None: the base model
    adapter_version: Version = 0
    adapter_sha256: Short = ""  # of the weights file; "" for the base model or when not known
    adapter_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_ADAPTER_RANK)] = 0  # 0: unknown
    # Tokens an earlier attempt generated and streamed (failover): recomputed with the prompt, then continued.
    output_ids: TokenIds = msgspec.field(default_factory=list)
    deadline: Seconds | None = None  # unix seconds
    tenant: Short = ""
    ttft_slo_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] | None = None
    attempt: Count = 0  # 0: the first; n: the gateway's n-th failover of it
    group: Id | None = None  # shared prefill with the group's requests of the same prompt (`step_scheduler`)
    cache_salt: Id = ""  # prefix caching: only requests with the same salt share cached KV

    def __post_init__(self) -> None:
        if len(self.prompt_ids) + len(self.output_ids) > MAX_LIST:
            raise ValueError(f"prompt_ids + output_ids hold more than {MAX_LIST} tokens")
        try:
            check_endpoint(self.reply_to)
        except BadEndpointError as e:
            raise ValueError(f"reply_to: {e}") from None

    @property
    def adapter_key(self) -> tuple[str, int] | None:
        """(name, version) of its adapter; None for the base model."""
        return (self.adapter, self.adapter_version) if self.adapter else None
