"""One generation a client asks for, from either edge: a `GenerationRequest`, built by `msgspec.convert`.

Each edge maps its body to plain fields (`Fields`: the gRPC API's GenerateRequest in `grpc_fields`, an
HTTP body in `http/drafts.py`), and the generation core parses them after admission (`parse`): the
struct's annotations check every bound (declared once, here or in `loraserve/bounds.py` and
`loraserve/params.py`, which the scheduler's `RequestSpec` shares), then `check_limits` checks what
depends on the model (vocabulary, context, prompt bytes). Every problem is an InvalidRequestError naming
the field as the client wrote it (`sampling.temperature`, `prompt.token_ids`), whichever edge it came from.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

import msgspec

from loraserve.bounds import TokenIds, TtftSlo
from loraserve.convert import constraint_from_pb, sampling_fields_of_pb
from loraserve.errors import InvalidRequestError
from loraserve.gateway.adapter_versions import AdapterVersion
from loraserve.gateway.validation import AdapterCheck, Limits, check_limits
from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.struct_errors import invalid_field
from loraserve.structured import Constraint
from loraserve.v1 import gateway_pb2

MAX_CLIENT_ID = 128  # characters of a client's request id, prefill group or cache salt
MAX_STOP_SEQUENCES = 8

Fields = dict[str, Any]  # a GenerationRequest's fields, as an edge read them, not checked yet
ClientId = Annotated[str, msgspec.Meta(max_length=MAX_CLIENT_ID)]
# The client's names of the fields whose path in the struct differs (`$.sampling.max_new_tokens`).
CLIENT_NAMES = {
    "prompt_ids": "prompt.token_ids",
    "prompt_text": "prompt.text",
    "sampling.max_new_tokens": "max_new_tokens",
    "sampling.stop_token_ids": "stop_token_ids",
}
UNPREFIXED = ("max_new_tokens", "stop_token_ids")  # sampling parameters the APIs name at the top level


class GenerationRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A generation's fields, each within its bounds (`parse` builds it). `msgspec.structs.replace` makes
    a changed copy (the gateway's adapter name, the compiled grammar)."""

    sampling: SamplingParams  # max_new_tokens resolved (0 asks for the limits' default)
    adapter: str | None = None  # None: the base model
    prompt_text: str | None = None  # exactly one of prompt_text and prompt_ids
    prompt_ids: TokenIds | None = None
    stop: Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_STOP_SEQUENCES)] = ()
    client_request_id: ClientId = ""
    ttft_slo_s: TtftSlo = 0.0  # time-to-first-token target; 0: none
    include_stop: bool = False  # the stop sequence that ended the text stays at its end
    keep_special_tokens: bool = False  # special tokens' text stays in the text
    prefill_group: ClientId = ""  # shared prefill with the caller's requests of this group and prompt
    cache_salt: ClientId = ""  # prefix caching: shared only with the caller's requests of this salt
    # structured output as the caller asked for it, not compiled yet: the generation core compiles it in
    # the gateway's sandbox (`constraints.py`) and puts the grammar into `sampling` (`with_grammar`)
    constraint: Constraint | None = None

    def with_grammar(self, grammar: str) -> GenerationRequest:
        """This request with its constraint compiled: `grammar` in its sampling parameters."""
        sampling = msgspec.structs.replace(self.sampling, grammar=grammar)
        return msgspec.structs.replace(self, sampling=sampling, constraint=None)

    def to_spec(
        self,
        request_id: str,
        prompt_ids: list[int],
        version: AdapterVersion,
        *,
        reply_to: str,
        arrival: float,
        deadline: float | None,
        tenant: str,
        attempt: int = 0,
        output_ids: list[int] | None = None,
        request_key: str = "",
    ) -> RequestSpec:
        """The scheduler's record of one attempt of this generation (`attempt` earlier ones lost, which
        streamed `output_ids`): its fields as they are, the adapter version the gateway resolved, the
        gateway's token sink, and the caller's group, salt and request key (`request_key`: an HTTP body's;
        "": the prefill group) prefixed with the tenant, so tenants never share a prefill, cached KV or a
        batch share."""
        key = request_key or self.prefill_group
        return RequestSpec(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=self.sampling,
            reply_to=reply_to,
            arrival=arrival,
            adapter=self.adapter,
            adapter_version=version.version,
            adapter_sha256=version.sha256,
            adapter_rank=version.rank if self.adapter else 0,
            output_ids=output_ids or [],
            deadline=deadline or None,
            tenant=tenant,
            ttft_slo_s=self.ttft_slo_s or None,
            attempt=attempt,
            group=f"{tenant}/{self.prefill_group}" if self.prefill_group else None,
            cache_salt=f"{len(tenant)}:{tenant}/{self.cache_salt}",
            request_key=f"{tenant}/{key}" if key else "",
        )


def parse(fields: Fields, limits: Limits, check_adapter: AdapterCheck | None = None) -> GenerationRequest:
    """The request `fields` describe, checked: its annotations, then the model's limits (`check_limits`);
    the first problem is an InvalidRequestError naming the field. Empty values mean defaults, as in the
    proto (`sampling.max_new_tokens` 0: the limits' default; `adapter` "": the base model)."""
    sampling = dict(fields.get("sampling", {}))
    sampling["max_new_tokens"] = sampling.get("max_new_tokens") or limits.default_max_new_tokens
    asked = {**fields, "sampling": _in_order(sampling, SamplingParams), "adapter": fields.get("adapter") or None}
    try:
        request = msgspec.convert(_in_order(asked, GenerationRequest), GenerationRequest)
    except msgspec.ValidationError as e:
        raise invalid_field(e, CLIENT_NAMES) from None
    except InvalidRequestError as e:  # a sampling value out of range (`check_sampling`)
        raise InvalidRequestError(e.field if e.field in UNPREFIXED else f"sampling.{e.field}", e.problem) from None
    return check_limits(request, limits, check_adapter)


def _in_order(fields: Fields, struct: type[msgspec.Struct]) -> Fields:
    """`fields` in the order `struct` declares them (then any others): msgspec checks a dict's values in
    its order, so a request with two bad fields is refused for the same one whichever edge read it."""
    return {name: fields[name] for name in struct.__struct_fields__ if name in fields} | fields


def grpc_fields(request: gateway_pb2.GenerateRequest) -> Fields:
    """The gRPC API's request as fields (InvalidRequestError if its structured output asks for no kind)."""
    kind = request.WhichOneof("prompt")
    sampling = sampling_fields_of_pb(request.sampling)
    sampling.update(max_new_tokens=request.max_new_tokens, stop_token_ids=request.stop_token_ids[:])
    constraint = None
    if request.sampling.HasField("structured_output"):  # named as its other sampling fields are
        constraint = constraint_from_pb(request.sampling.structured_output)
        constraint = replace(constraint, field=f"sampling.{constraint.field}")
    return {
        "adapter": request.adapter,
        "prompt_text": request.text if kind == "text" else None,
        "prompt_ids": request.token_ids.ids[:] if kind == "token_ids" else None,
        "sampling": sampling,
        "stop": request.stop[:],
        "client_request_id": request.client_request_id,
        "ttft_slo_s": request.ttft_slo_s,
        "include_stop": request.include_stop_str_in_output,
        "keep_special_tokens": request.keep_special_tokens,
        "prefill_group": request.prefill_group,
        "cache_salt": request.cache_salt,
        "constraint": constraint,
    }
