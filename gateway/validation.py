"""Validation of public requests: every problem is an InvalidRequestError naming the field."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from loraserve.convert import sampling_from_pb
from loraserve.errors import InvalidRequestError
from loraserve.names import PUBLIC_NAME, TENANT_NAME
from loraserve.params import SamplingParams
from loraserve.v1 import gateway_pb2

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


def validate_generate(
    request: gateway_pb2.GenerateRequest, limits: Limits, check_adapter: Callable[[str], str] | None = None
) -> ValidRequest:
    """Every field checked; `check_adapter(name)` (default: a public name) returns the adapter name or raises."""
    adapter = request.adapter or None
    if adapter is not None and check_adapter is not None:
        adapter = check_adapter(adapter)
    elif adapter is not None and not PUBLIC_NAME.fullmatch(adapter):
        raise InvalidRequestError("adapter", f"{adapter[:64]!r} is not a valid adapter name")
    kind = request.WhichOneof("prompt")
    text, ids = None, None
    if kind is None or (kind == "text" and not request.text) or (kind == "token_ids" and not request.token_ids.ids):
        raise InvalidRequestError("prompt", "is empty: give text or at least one token id")
    if kind == "text":
        if len(request.text.encode()) > limits.max_prompt_bytes:
            raise InvalidRequestError("prompt.text", f"is longer than {limits.max_prompt_bytes} bytes")
        text = request.text
    else:
        ids = list(request.token_ids.ids)
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                "prompt.token_ids", f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})"
            )
    if len(request.stop) > limits.max_stop_sequences:
        raise InvalidRequestError(
            "stop", f"at most {limits.max_stop_sequences} stop sequences, got {len(request.stop)}"
        )
    for stop in request.stop:
        if not stop or len(stop.encode()) > limits.max_stop_bytes:
            raise InvalidRequestError("stop", f"each stop sequence must be 1..{limits.max_stop_bytes} bytes")
    bad_stop = next((t for t in request.stop_token_ids if t >= limits.vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequestError("stop_token_ids", f"token id {bad_stop} is outside the vocabulary")
    if len(request.client_request_id) > limits.max_client_id_chars:
        raise InvalidRequestError("client_request_id", f"is longer than {limits.max_client_id_chars} characters")
    for name in ("prefill_group", "cache_salt"):
        if len(getattr(request, name)) > limits.max_client_id_chars:
            raise InvalidRequestError(name, f"is longer than {limits.max_client_id_chars} characters")
    max_new = request.max_new_tokens or limits.default_max_new_tokens
    if max_new >= limits.max_context:
        raise InvalidRequestError(
            "max_new_tokens",
            f"{max_new} leaves no room for a prompt in the context length {limits.max_context}",
        )
    try:
        sampling = sampling_from_pb(request.sampling, max_new, list(request.stop_token_ids))
    except InvalidRequestError as e:
        field = e.field if e.field in ("max_new_tokens", "stop_token_ids") else f"sampling.{e.field}"
        raise InvalidRequestError(field, str(e).split(": ", 1)[1]) from None
    if not math.isfinite(request.ttft_slo_s) or not 0 <= request.ttft_slo_s <= MAX_TTFT_SLO_S:
        raise InvalidRequestError("ttft_slo_s", f"must be 0 (none) or seconds up to {MAX_TTFT_SLO_S:g}")
    return ValidRequest(
        adapter,
        text,
        ids,
        sampling,
        tuple(request.stop),
        request.client_request_id,
        request.ttft_slo_s,
        request.include_stop_str_in_output,
        request.keep_special_tokens,
        request.prefill_group,
        request.cache_salt,
    )


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
