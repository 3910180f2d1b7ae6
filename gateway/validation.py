"""Validation of public requests: every problem is an InvalidRequestError naming the field."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import msgspec

from loraserve.convert import constraint_from_pb, sampling_from_pb
from loraserve.errors import InvalidRequestError
from loraserve.names import PUBLIC_NAME, TENANT_NAME
from loraserve.params import SamplingParams, check_constrainable
from loraserve.structured import Constraint
from loraserve.v1 import common_pb2, gateway_pb2

MAX_TTFT_SLO_S = 86400.0
CLIENT_METADATA = "x-loraserve-client"  # without an auth file: the caller's id, for fair scheduling
END_USER_METADATA = "x-loraserve-end-user"  # the caller's end user (OpenAI's `user`), put on the trace
MAX_END_USER_CHARS = 256


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    default_max_new_tokens: int = 64
    max_stop_sequences: int = 8
    max_stop_bytes: int = 256
    max_prompt_bytes: int = 1 << 20
    max_client_id_chars: int = 128


@dataclass(frozen=True)
class ValidRequest:
    adapter: str | None
    prompt_text: str | None  # exactly one of prompt_text and prompt_ids
    prompt_ids: list[int] | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    client_request_id: str
    ttft_slo_s: float = 0.0  # time-to-first-token target; 0: none
    include_stop: bool = False  # the stop sequence that ended the text stays at its end
    keep_special_tokens: bool = False  # special tokens' text stays in the text
    prefill_group: str = ""  # shared prefill with the caller's requests of this group and prompt
    cache_salt: str = ""  # prefix caching: shared only with the caller's requests of this salt
    # structured output as the caller asked for it, not compiled yet: the generation core compiles it in
    # the gateway's sandbox (`constraints.py`) and puts the grammar into `sampling` (`with_grammar`)
    constraint: Constraint | None = None

    def with_grammar(self, grammar: str) -> ValidRequest:
        """This request with its constraint compiled: `grammar` in its sampling parameters."""
        return replace(self, sampling=msgspec.structs.replace(self.sampling, grammar=grammar), constraint=None)


AdapterCheck = Callable[[str], str]  # an adapter name as the caller wrote it -> the name, or InvalidRequestError
SamplingBuilder = Callable[[int, list[int]], SamplingParams]  # (max_new_tokens, stop_token_ids) -> checked params
ConstraintBuilder = Callable[[], Constraint | None]  # the request's output constraint (uncompiled), or None


def validate_generate(
    request: gateway_pb2.GenerateRequest, limits: Limits, check_adapter: AdapterCheck | None = None
) -> ValidRequest:
    """The gRPC API's request, every field checked (`validate_request`)."""
    kind = request.WhichOneof("prompt")
    return validate_request(
        limits,
        check_adapter,
        adapter=request.adapter,
        prompt_text=request.text if kind == "text" else None,
        prompt_ids=list(request.token_ids.ids) if kind == "token_ids" else None,
        sampling=partial(sampling_from_pb, request.sampling, compile_structured=False),
        constraint=partial(_constraint_of, request.sampling),
        max_new_tokens=request.max_new_tokens,
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
        client_request_id=request.client_request_id,
        ttft_slo_s=request.ttft_slo_s,
        include_stop=request.include_stop_str_in_output,
        keep_special_tokens=request.keep_special_tokens,
        prefill_group=request.prefill_group,
        cache_salt=request.cache_salt,
    )


def validate_request(
    limits: Limits,
    check_adapter: AdapterCheck | None,
    *,
    adapter: str,
    prompt_text: str | None,
    prompt_ids: list[int] | None,
    sampling: SamplingBuilder,
    constraint: ConstraintBuilder | None = None,
    max_new_tokens: int = 0,
    stop: tuple[str, ...] = (),
    stop_token_ids: tuple[int, ...] = (),
    client_request_id: str = "",
    ttft_slo_s: float = 0.0,
    include_stop: bool = False,
    keep_special_tokens: bool = False,
    prefill_group: str = "",
    cache_salt: str = "",
) -> ValidRequest:
    """A generation's fields, from any edge, checked: the first problem is an InvalidRequestError naming
    the field. Empty values mean defaults, as in the proto (`max_new_tokens` 0: the limits' default).
    `check_adapter(name)` (default: a public name) returns the adapter name or raises; `sampling` builds
    the sampling parameters once `max_new_tokens` is known, and `constraint` the output constraint, which
    stays uncompiled (`ValidRequest.constraint`)."""
    adapter_name = adapter or None
    if adapter_name is not None and check_adapter is not None:
        adapter_name = check_adapter(adapter_name)
    elif adapter_name is not None and not PUBLIC_NAME.fullmatch(adapter_name):
        raise InvalidRequestError("adapter", f"{adapter_name[:64]!r} is not a valid adapter name")
    if not prompt_text and not prompt_ids:
        raise InvalidRequestError("prompt", "is empty: give text or at least one token id")
    if prompt_text is not None:
        if len(prompt_text.encode()) > limits.max_prompt_bytes:
            raise InvalidRequestError("prompt.text", f"is longer than {limits.max_prompt_bytes} bytes")
        prompt_ids = None
    else:
        prompt_ids = list(prompt_ids)
        bad = next((t for t in prompt_ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                "prompt.token_ids", f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})"
            )
    if len(stop) > limits.max_stop_sequences:
        raise InvalidRequestError("stop", f"at most {limits.max_stop_sequences} stop sequences, got {len(stop)}")
    for sequence in stop:
        if not sequence or len(sequence.encode()) > limits.max_stop_bytes:
            raise InvalidRequestError("stop", f"each stop sequence must be 1..{limits.max_stop_bytes} bytes")
    bad_stop = next((t for t in stop_token_ids if t >= limits.vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequestError("stop_token_ids", f"token id {bad_stop} is outside the vocabulary")
    if len(client_request_id) > limits.max_client_id_chars:
        raise InvalidRequestError("client_request_id", f"is longer than {limits.max_client_id_chars} characters")
    for name, value in (("prefill_group", prefill_group), ("cache_salt", cache_salt)):
        if len(value) > limits.max_client_id_chars:
            raise InvalidRequestError(name, f"is longer than {limits.max_client_id_chars} characters")
    max_new = max_new_tokens or limits.default_max_new_tokens
    if max_new >= limits.max_context:
        raise InvalidRequestError(
            "max_new_tokens",
            f"{max_new} leaves no room for a prompt in the context length {limits.max_context}",
        )
    try:
        params = sampling(max_new, list(stop_token_ids))
        asked = constraint() if constraint is not None else None
        if asked is not None:
            check_constrainable(params)
    except InvalidRequestError as e:
        field = e.field if e.field in ("max_new_tokens", "stop_token_ids") else f"sampling.{e.field}"
        raise InvalidRequestError(field, str(e).split(": ", 1)[1]) from None
    if not math.isfinite(ttft_slo_s) or not 0 <= ttft_slo_s <= MAX_TTFT_SLO_S:
        raise InvalidRequestError("ttft_slo_s", f"must be 0 (none) or seconds up to {MAX_TTFT_SLO_S:g}")
    return ValidRequest(
        adapter_name,
        prompt_text,
        prompt_ids,
        params,
        stop,
        client_request_id,
        ttft_slo_s,
        include_stop,
        keep_special_tokens,
        prefill_group,
        cache_salt,
        asked,
    )


def _constraint_of(sampling: common_pb2.SamplingParameters) -> Constraint | None:
    """The gRPC request's constraint, named as its other sampling fields are (`sampling.structured_output.KIND`)."""
    if not sampling.HasField("structured_output"):
        return None
    constraint = constraint_from_pb(sampling.structured_output)
    return replace(constraint, field=f"sampling.{constraint.field}")


def fairness_tenant(tenant: str, open_access: bool, metadata: dict[str, str]) -> str:
    """Whose request it is for the scheduler's per-tenant fairness: the authenticated tenant; with
    open access (no auth file), the caller's `x-loraserve-client` metadata when it sends one."""
    client = metadata.get(CLIENT_METADATA, "") if open_access else ""
    if not client:
        return tenant
    if not TENANT_NAME.fullmatch(client):
        raise InvalidRequestError(CLIENT_METADATA, "must be letters, digits, '-' or '_', at most 64 characters")
    return client


def check_context(prompt_ids: list[int], sampling: SamplingParams, limits: Limits) -> None:
    """After tokenization: the prompt and the tokens to generate must fit the context."""
    total = len(prompt_ids) + sampling.max_new_tokens
    if len(prompt_ids) >= limits.max_context:
        raise InvalidRequestError(
            "prompt", f"{len(prompt_ids)} tokens do not fit the context length {limits.max_context}"
        )
    if total > limits.max_context:
        raise InvalidRequestError(
            "max_new_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
            f"exceeds the context length {limits.max_context}; lower max_new_tokens to at most "
            f"{limits.max_context - len(prompt_ids)}",
        )
