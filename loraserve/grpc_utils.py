"""gRPC edges shared by every server: exceptions to statuses, internal channels, health, reflection.

Inner code raises `loraserve.errors` exceptions; `ErrorInterceptor` (one per server) turns them
into the status they name, and anything unexpected into INTERNAL with an id that points at the
logged traceback. Calls to another role go through `internal_call`, which turns that role's
status back into the same exception (or UNAVAILABLE when it cannot be reached), so a failure
crosses hops unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraserve import errors

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.enable_retries", 0),
]

_BY_STATUS: dict[str, type[errors.LoraserveError]] = {
    "INVALID_ARGUMENT": errors.InvalidAdapterError,
    "NOT_FOUND": errors.NotFoundError,
    "ALREADY_EXISTS": errors.AlreadyExistsError,
    "RESOURCE_EXHAUSTED": errors.ResourceExhaustedError,
    "UNAVAILABLE": errors.UnavailableError,
    "DEADLINE_EXCEEDED": errors.DeadlineExceededError,
    "PERMISSION_DENIED": errors.PermissionDeniedError,
    "FAILED_PRECONDITION": errors.FailedPreconditionError,
}


def status_code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)


def _code_and_message(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, errors.LoraserveError):
        return status_code(exc.status), str(exc)
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s", incident, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (incident {incident}; see the server log)"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by handlers to gRPC statuses, for all four kinds of RPC."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer
        )


def _wrap_unary(behavior):
    async def wrapper(request, context):
        try:
            return await behavior(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            code, message = _code_and_message(exc)
            await context.abort(code, message)

    return wrapper


def _wrap_stream(behavior):
    async def wrapper(request, context):
        try:
            async for item in behavior(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            code, message = _code_and_message(exc)
            await context.abort(code, message)

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
        cls = _BY_STATUS.get(code.name, errors.LoraserveError)
        exc = cls.__new__(cls)
        Exception.__init__(exc, e.details() or f"{what} failed with {code.name}")
        raise exc from None


def internal_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def new_server(bind: str, interceptors: list[Any] | None = None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with the error interceptor, listening on `bind`; returns (server, port)."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), *(interceptors or [])], options=CHANNEL_OPTIONS)
    port = server.add_insecure_port(bind)
    if port == 0:
        raise errors.UnavailableError(f"cannot listen on {bind} (address in use?)")
    return server, port


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard grpc.health.v1 (NOT_SERVING until the caller says otherwise) and server reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)
