"""Errors every role raises, each with the gRPC status it leaves a server with.

Inner code raises these plain exceptions; only the gRPC edges (one interceptor per server)
turn them into statuses, so the mapping lives in one place: `status` names a
`grpc.StatusCode` member.
"""

from __future__ import annotations


class LoraserveError(Exception):
    """Base class: a failure with a message a user can act on."""

    status = "INTERNAL"


class InvalidRequestError(LoraserveError):
    """A request field is out of range or malformed; `field` names it."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidAdapterError(LoraserveError):
    """An adapter's files do not describe a LoRA adapter this base model can serve."""

    status = "INVALID_ARGUMENT"


class FailedPreconditionError(LoraserveError):
    """The server is not set up for this request (e.g. no adapter root for registering by path)."""

    status = "FAILED_PRECONDITION"


class InvalidModelError(FailedPreconditionError):
    """A model directory is missing files or describes an unsupported model."""


class InvalidConfigError(LoraserveError):
    """A service configuration value is out of range (raised at start-up)."""

    status = "INVALID_ARGUMENT"


class NotFoundError(LoraserveError):
    status = "NOT_FOUND"


class AdapterNotFoundError(NotFoundError):
    def __init__(self, name: str, known: list[str] | None = None):
        hint = ""
        if known is not None:
            shown = ", ".join(sorted(known)[:10]) or "none"
            hint = f"; registered adapters: {shown}" + (" ..." if len(known) > 10 else "")
        super().__init__(f"adapter {name!r} is not registered{hint}")
        self.name = name


class AlreadyExistsError(LoraserveError):
    status = "ALREADY_EXISTS"


class ResourceExhaustedError(LoraserveError):
    """A bounded resource (queue, host RAM budget, pool) cannot take this request now."""

    status = "RESOURCE_EXHAUSTED"


class UnavailableError(LoraserveError):
    """A role needed to serve the request is down or unreachable; retrying later may work."""

    status = "UNAVAILABLE"


class DeadlineExceededError(LoraserveError):
    status = "DEADLINE_EXCEEDED"


class PermissionDeniedError(LoraserveError):
    status = "PERMISSION_DENIED"


class DataLossError(LoraserveError):
    """Bytes do not match the content hash they were sent or stored with (corrupted on the way or on disk)."""

    status = "DATA_LOSS"
