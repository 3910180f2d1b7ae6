"""Validation of public requests against the model's limits: every problem is an InvalidRequestError naming
the field. A request's own bounds are its struct's annotations (`generation_request.py`); what depends on
the model (vocabulary, context, prompt bytes) and on the caller (adapter names) is checked here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from loraserve.errors import InvalidRequestError
from loraserve.names import PUBLIC_NAME, TENANT_NAME
from loraserve.params import SamplingParams, check_constrainable

if TYPE_CHECKING:
    from loraserve.gateway.generation_request import GenerationRequest

CLIENT_METADATA = "x-loraserve-client"  # without an auth file: the caller's id, for fair scheduling
END_USER_METADATA = "x-loraserve-end-user"  # the caller's end user (OpenAI's `user`), put on the trace
MAX_END_USER_CHARS = 256


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    default_max_new_tokens: int = 64
    max_stop_bytes: int = 256
    max_prompt_bytes: int = 1 << 20


AdapterCheck = Callable[[str], str]  # an adapter name as the caller wrote it -> the name, or InvalidRequestError


def check_limits(
    request: GenerationRequest, limits: Limits, check_adapter: AdapterCheck | None = None
) -> GenerationRequest:
    """`request` (its annotations checked) checked against the model's limits; the first problem is an
    InvalidRequestError naming the field. `check_adapter(name)` (default: a public name) returns the
    adapter name, which the returned request carries, or raises."""
    adapter = request.adapter
    if adapter is not None and check_adapter is not None:
        adapter = check_adapter(adapter)
    elif adapter is not None and not PUBLIC_NAME.fullmatch(adapter):
        raise InvalidRequestError("adapter", f"{adapter[:64]!r} is not a valid adapter name")
    text, ids = request.prompt_text, request.prompt_ids
    if not text and not ids:
        raise InvalidRequestError("prompt", "is empty: give text or at least one token id")
    if text is not None and len(text.encode()) > limits.max_prompt_bytes:
        raise InvalidRequestError("prompt.text", f"is longer than {limits.max_prompt_bytes} bytes")
    if text is None:
        _check_vocabulary("prompt.token_ids", ids, limits)
    for sequence in request.stop:
        if not sequence or len(sequence.encode()) > limits.max_stop_bytes:
            raise InvalidRequestError("stop", f"each stop sequence must be 1..{limits.max_stop_bytes} bytes")
    sampling = request.sampling
    _check_vocabulary("stop_token_ids", sampling.stop_token_ids, limits)
    if sampling.max_new_tokens >= limits.max_context:
        raise InvalidRequestError(
            "max_new_tokens",
            f"{sampling.max_new_tokens} leaves no room for a prompt in the context length {limits.max_context}",
        )
    if request.constraint is not None:
        try:
            check_constrainable(sampling)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"sampling.{e.field}", e.problem) from None
    return msgspec.structs.replace(request, adapter=adapter)


def _check_vocabulary(field: str, token_ids: Sequence[int], limits: Limits) -> None:
    bad = next((t for t in token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(field, f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")


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
