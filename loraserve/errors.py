"""Errors every role raises, each with the gRPC status it leaves a server with.

Inner code raises these plain exceptions; only the gRPC edges (one interceptor per server)
turn them into statuses, so the mapping lives in one place: `status` names a
`grpc.StatusCode` member. An error whose status alone does not say what it is carries a `reason`
too, which crosses a gRPC hop beside the status (`grpc_utils`) and picks its class again.
"""

from __future__ import annotations


class LoraserveError(Exception):
    """Base class: a failure with a message a user can act on."""

    status = "INTERNAL"
    reason = ""  # set where the status alone cannot tell this error from others (e.g. TOO_LARGE)


class InvalidRequestError(LoraserveError):
    """A request field is out of range or malformed; `field` names it."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.problem = field, message  # what is wrong, without the field (for whoever names it itself)


class InvalidAdapterError(LoraserveError):
    """An adapter's files do not describe a LoRA adapter this base model can serve."""

    status = "INVALID_ARGUMENT"


class TooLargeError(LoraserveError):
    """A payload over a size limit the server is configured with (an adapter over the store's
    --max-adapter-mb): refused as it is, not worth retrying (INVALID_ARGUMENT; HTTP 413)."""

    status = "INVALID_ARGUMENT"
    reason = "TOO_LARGE"


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
        """`known`: names to suggest. A tenant's own adapters (`TENANT~NAME`) are never listed: the
        hint may reach another tenant, who must not learn they exist."""
        hint = ""
        if known is not None:
            shown = ", ".join(sorted(k for k in known if "~" not in k)[:10]) or "none"
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


class UnauthenticatedError(LoraserveError):
    """The call carries no valid API key."""

    status = "UNAUTHENTICATED"


class DataLossError(LoraserveError):
    """Bytes do not match the content hash they were sent or stored with (corrupted on the way or on disk)."""

    status = "DATA_LOSS"


# The one table from a status name back to the error that carries it, for failures that cross a
# process boundary (a gRPC status from another role, an error_status in a TOKENS message).
_BY_STATUS: dict[str, type[LoraserveError]] = {
    "INVALID_ARGUMENT": InvalidAdapterError,
    "NOT_FOUND": NotFoundError,
    "ALREADY_EXISTS": AlreadyExistsError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "DATA_LOSS": DataLossError,
}


_BY_REASON: dict[str, type[LoraserveError]] = {TooLargeError.reason: TooLargeError}


def error_for_status(status: str, message: str, reason: str = "") -> LoraserveError:
    """The error a failure with gRPC status name `status` (and `reason`, when the other side gave
    one) is raised as here. Its `status` is kept where no class names it (CANCELLED, ABORTED, ...),
    so it crosses every hop unchanged; a status that says nothing (UNKNOWN, OK, or a name gRPC does
    not have) becomes INTERNAL."""
    cls = _BY_REASON.get(reason) or _BY_STATUS.get(status, LoraserveError)
    if cls.status != status:  # a reason that does not go with its status is not believed
        cls = _BY_STATUS.get(status, LoraserveError)
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    if error.status != status and status in _PASSED_ON:
        error.status = status
    return error


_PASSED_ON = frozenset(
    {"CANCELLED", "INVALID_ARGUMENT", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAUTHENTICATED"}
)
