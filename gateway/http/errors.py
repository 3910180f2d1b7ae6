"""Errors at the HTTP edge: one table from loraserve's status names to HTTP statuses, in OpenAI's shape.

Every failure leaves as `{"error": {"message", "type", "param", "code"}}` with the HTTP status its gRPC
status name maps to, so the two edges never disagree. `param` names the OpenAI parameter at fault: each
API's table (`PARAMS`, `CHAT_PARAMS`, `RESPONSES_PARAMS`) maps the inner code's fields to its own names.
Anything that is not a LoraserveError is logged with an incident id and leaves as 500.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Mapping
from typing import Any

from loraserve import errors

log = logging.getLogger(__name__)

# gRPC status name -> (HTTP status, OpenAI error type)
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "ABORTED": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNIMPLEMENTED": (501, "not_implemented_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
    "DATA_LOSS": (500, "internal_error"),
    "INTERNAL": (500, "internal_error"),
}
CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}

# the inner code's field -> the OpenAI parameter it came from (`sampling.` is dropped first; `prompt`: the
# prompt's, whichever field of it), per API: completions, chat completions, the Responses API
PARAMS = {"adapter": "model", "max_new_tokens": "max_tokens", "prompt": "prompt"}
CHAT_PARAMS = PARAMS | {"prompt": "messages"}
RESPONSES_PARAMS = PARAMS | {
    "max_new_tokens": "max_output_tokens",
    "prompt": "input",
    "messages": "input",
    "response_format": "text.format",
}


class HttpError(Exception):
    """A failure with its HTTP status, OpenAI body and headers, ready to send."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers or {}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(param: str, message: str) -> HttpError:
    """400 naming `param` (a check the HTTP edge makes itself: an OpenAI parameter we do not support)."""
    return HttpError(400, error_body(f"{param}: {message}", "invalid_request_error", param))


def http_error(exc: BaseException, params: Mapping[str, str] = PARAMS, retry_after_s: float | None = None) -> HttpError:
    """`exc` as an HTTP failure, naming the parameter `params` (the API's table) says its field came from;
    `retry_after_s` becomes a Retry-After header (a quota refusal's hint), as does the hint a refusal
    carries itself (`retry_after_ms`) when none is given."""
    if not isinstance(exc, errors.LoraserveError):
        incident = uuid.uuid4().hex[:12]
        log.error("internal error %s", incident, exc_info=exc)
        message = f"internal error (incident {incident}; see the server log)"
        return HttpError(500, error_body(message, "internal_error"))
    status, kind = HTTP_STATUS.get(exc.status, (500, "internal_error"))
    if isinstance(exc, errors.TooLargeError):  # over a configured size limit: 413, which clients do not retry
        status = 413
    field = getattr(exc, "field", None)
    param = _param(field, params)
    message = str(exc) if field is None else f"{param}: {str(exc).split(': ', 1)[-1]}"
    if param == "model" and status == 400:  # a name no adapter can have: as unknown as a missing one
        status, kind = HTTP_STATUS["NOT_FOUND"]
    if isinstance(exc, errors.NotFoundError):
        param = "model"
    if retry_after_s is None and getattr(exc, "retry_after_ms", None) is not None:
        retry_after_s = exc.retry_after_ms / 1000
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else {}
    return HttpError(status, error_body(message, kind, param, CODES.get(status)), headers)


def _param(field: str | None, params: Mapping[str, str]) -> str | None:
    if field is None:
        return None
    field = field.removeprefix("sampling.")
    return params.get("prompt" if field.startswith("prompt.") else field, field)
