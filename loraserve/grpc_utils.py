"""gRPC edges shared by every server: exceptions to statuses, internal channels, health, reflection.

Inner code raises `loraserve.errors` exceptions; `ErrorInterceptor` (one per server) turns them
into the status they name, and anything unexpected into INTERNAL with an id that points at the
logged traceback; a call whose client has gone (its status cannot be sent) ends quietly. It also
wraps every request deserializer: a message that is not valid protobuf (corrupt wire format,
invalid UTF-8 in a string field) is the caller's mistake, so it becomes INVALID_ARGUMENT naming the
message type, not the UNKNOWN grpc picks for a deserializer that raises.
Calls to another role go through `internal_call`, which turns that role's status back into the
same exception (or UNAVAILABLE when it cannot be reached), so a failure crosses hops unchanged: an
error with a `reason` (one its status alone does not identify) sends it as trailing metadata
`loraserve-reason`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from loraserve import errors
from loraserve.endpoints import listen_port
from loraserve.errors import InvalidRequestError
from loraserve.grpc_token import token_interceptors
from loraserve.reflection import add_reflection

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 * 2**20
KEEPALIVE_TIME_MS = 20_000  # how often a connection with nothing to send pings its peer
MIN_PING_INTERVAL_MS = 500  # servers accept a client's pings this often, calls or not
MAX_PING_STRIKES = 2  # pings that come faster are tolerated this many times, then GOAWAY too_many_pings
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.enable_retries", 0),
]
# Servers must accept the pings clients send, or they answer GOAWAY "too_many_pings" and every call
# on the connection fails UNAVAILABLE. gRPC's default server policy allows one ping per 5 minutes
# without data and none at all with no call open, far below the 20 s keepalive of the roles' channels
# (and of many public clients). gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is
# the "min_ping_interval_without_data_ms" key.
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),  # finds clients that vanished
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
]


def status_code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)


def code_and_message(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a call that raised `exc` ends with, and its message: a LoraserveError's own, else
    INTERNAL naming an incident that the log holds with the traceback."""
    if isinstance(exc, errors.LoraserveError):
        return status_code(exc.status), str(exc)
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s", incident, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (incident {incident}; see the server log)"


@dataclass(frozen=True)
class Undecodable:
    """What the wrapped deserializer returns for bytes that are not a valid request message.

    grpc's server answers a deserializer that raises with a status of its own choosing (UNKNOWN);
    returning this marker instead lets the wrapped handler refuse the request with INVALID_ARGUMENT.
    """

    error: InvalidRequestError


def safe_deserializer(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer`, but returning an `Undecodable` instead of raising on malformed bytes."""
    if deserializer is None:
        return None
    message_type = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    what = message_type.full_name if message_type is not None else "the request message"

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # DecodeError, UnicodeDecodeError, ...: the bytes are at fault
            reason = str(e).rsplit("': ", 1)[-1] or type(e).__name__  # drop protobuf's "Error parsing ... '<type>'"
            return Undecodable(InvalidRequestError("request", f"is not a valid {what} message ({reason})"))

    return deserialize


def _check_decoded(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise request.error
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The client's stream, raising InvalidRequestError at the first undecodable message."""
    async for request in requests:
        yield _check_decoded(request)


def _checked_request(request: Any, streaming: bool) -> Any:
    return _checked_stream(request) if streaming else _check_decoded(request)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by handlers (and undecodable requests) to gRPC statuses, for all four kinds of RPC."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        deserializer = safe_deserializer(handler.request_deserializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, False), deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, False), deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, True), deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, True), deserializer, handler.response_serializer
        )


async def _answer(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with the status `exc` names, unless it has ended already.

    A status that went out, or was attempted (an abort whose client had left: grpc raises from the
    abort then), leaves nothing to answer: a second abort would only raise "Abort already called!"
    and have grpc log it as an unexpected error. The call's end is grpc's to finish quietly."""
    if context.done():
        log.debug("call already ended: %r", exc)
        return
    code, message = code_and_message(exc)
    reason = getattr(exc, "reason", "")  # said beside the status, so `internal_call` picks the same error
    try:
        await context.abort(code, message, ((REASON_KEY, reason),) if reason else ())  # (): any set before
    except grpc.aio.AbortError:
        raise
    except Exception as e:  # the client left while the status was being sent: nobody to tell
        log.debug("could not send %s to a client that left: %r", code.name, e)


def _wrap_unary(behavior, streaming: bool):
    async def wrapper(request, context):
        try:
            return await behavior(_checked_request(request, streaming), context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _answer(context, exc)

    return wrapper


def _wrap_stream(behavior, streaming: bool):
    if not inspect.isasyncgenfunction(behavior):  # it writes with context.write (grpc_health's Watch)
        return _wrap_unary(behavior, streaming)

    async def wrapper(request, context):
        try:
            async for item in behavior(_checked_request(request, streaming), context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _answer(context, exc)

    return wrapper


async def internal_call(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """Await an RPC to another role; its failure comes back as the matching LoraserveError."""
    try:
        return await call()
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not e.details():
            raise errors.UnavailableError(f"{what} is unreachable") from None
        if code == grpc.StatusCode.UNAVAILABLE:
            raise errors.UnavailableError(f"{what} is unavailable: {e.details()}") from None
        reason = next((v for k, v in (e.trailing_metadata() or ()) if k == REASON_KEY and isinstance(v, str)), "")
        raise errors.error_for_status(code.name, e.details() or f"{what} failed with {code.name}", reason) from None


REASON_KEY = "loraserve-reason"  # trailing metadata: the `reason` of the error a status came from (TOO_LARGE)
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a RESOURCE_EXHAUSTED quota refusal: when to retry


# A role restarted after a long outage must be found again within about a second: gRPC's default
# reconnect backoff grows to 120 s.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def internal_channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A channel to another role: large messages, keepalive, reconnect backoff capped at 1 s; every
    call carries the internal `token` when given (`loraserve/grpc_token.py`)."""
    return grpc.aio.insecure_channel(
        address, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS, interceptors=token_interceptors(token)
    )


def new_server(
    bind: str, interceptors: list[Any] | None = None, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with the error interceptor, listening on `bind` (TLS with `credentials`,
    else plaintext); returns (server, port)."""
    listen_port(bind)  # a port grpc would take modulo 65536 is refused first
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), *(interceptors or [])], options=SERVER_OPTIONS)
    port = server.add_insecure_port(bind) if credentials is None else server.add_secure_port(bind, credentials)
    if port == 0:
        raise errors.UnavailableError(f"cannot listen on {bind} (address in use?)")
    return server, port


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard grpc.health.v1 (NOT_SERVING until the caller says otherwise) and server reflection (v1 and
    v1alpha, `loraserve.reflection`)."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    add_reflection(server, [*service_names, health.SERVICE_NAME])
    return servicer


async def set_serving(servicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)
