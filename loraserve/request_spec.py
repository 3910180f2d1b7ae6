"""One request, as the scheduler accepted it: an immutable record built once and read everywhere after.

The scheduler's Submit servicer turns the gateway's SubmitRequest into a `RequestSpec` (`scheduler/submit.py`);
the spec waits in the scheduler's queue, travels unchanged inside the ASSIGN (`loraserve/wire.py`),
and the worker's `Request` holds it as received. Nothing changes it on the way: a failover builds a
new spec from the gateway's new Submit.

Its types are its wire schema (msgspec over msgpack): every bound is an annotation, unknown fields
are refused, and `__post_init__` checks what crosses fields (the reply address, the token total; the
sampling values check themselves, `SamplingParams`), so a decoded spec is a valid one.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from loraserve.bounds import MAX_LIST, Count, Id, Seconds, Short, TokenIds, TtftSlo, Version
from loraserve.endpoints import BadEndpointError, check_endpoint
from loraserve.errors import InvalidRequestError
from loraserve.params import SamplingParams
from loraserve.struct_errors import DECODE_ERRORS, decode_problem, invalid_field

MAX_ADAPTER_RANK = 4096  # far above any rank a store admits (its --max-lora-rank)
NO_REPLY = "ipc://no-reply"  # the reply address of a spec made in-process (an offline request, a hint's view)
Endpoint = Annotated[str, msgspec.Meta(max_length=1024)]  # tcp:// or ipc://, checked by `check_endpoint`


class RequestSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything about one request that is fixed once the scheduler accepted it."""

    request_id: Id
    prompt_ids: TokenIds
    sampling: SamplingParams  # the sampler's own type: the worker's engine uses it as decoded
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
    ttft_slo_s: TtftSlo | None = None
    attempt: Count = 0  # 0: the first; n: the gateway's n-th failover of it
    group: Id | None = None  # shared prefill with the group's requests of the same prompt (`step_scheduler`)
    cache_salt: Id = ""  # prefix caching: only requests with the same salt share cached KV
    request_key: Id = ""  # the client request it is a generation of (batch share, quota); "": its own

    def __post_init__(self) -> None:
        """Raises InvalidRequestError naming the field: the scheduler's edge answers INVALID_ARGUMENT, the
        worker's decoder drops the message."""
        if len(self.prompt_ids) + len(self.output_ids) > MAX_LIST:
            raise InvalidRequestError("output_ids", f"prompt_ids + output_ids must hold at most {MAX_LIST} tokens")
        try:
            check_endpoint(self.reply_to)
        except BadEndpointError as e:
            raise InvalidRequestError("reply_to", str(e)) from None

    @property
    def adapter_key(self) -> tuple[str, int] | None:
        """(name, version) of its adapter; None for the base model."""
        return (self.adapter, self.adapter_version) if self.adapter else None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(RequestSpec)


def encode_spec(spec: RequestSpec) -> bytes:
    """`spec` as msgpack: what a SubmitRequest's `spec` carries from the gateway to the scheduler."""
    return _ENCODER.encode(spec)


def decode_spec(data: bytes, field: str = "spec") -> RequestSpec:
    """The RequestSpec `data` holds (`encode_spec`), every bound and check applied; InvalidRequestError
    naming `field`, or the spec's field (`spec.ttft_slo_s`) whose value is wrong, if it is not one."""
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as e:
        error = invalid_field(e, whole=field)
        name = error.field if error.field == field else f"{field}.{error.field}"
        raise InvalidRequestError(name, error.problem) from None
    except DECODE_ERRORS as e:
        raise InvalidRequestError(field, decode_problem(e)) from None
