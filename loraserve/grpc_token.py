"""The internal gRPC token: the scheduler's and the store's ports answer only callers that hold it.

Server side, `TokenInterceptor` refuses every call without `authorization: Bearer <token>` with
UNAUTHENTICATED (compared in constant time), except health and reflection, which stay open for
probes. Client side, `token_interceptors` add the header to every call of a channel. The token comes
from the internal keys directory (`loraserve/internal_auth.py`).
"""

from __future__ import annotations

import hmac

import grpc

from loraserve.grpc_streams import refuse_stream

OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(presented.encode("utf-8", "replace"), self._expected):
            return handler
        return _refusing(handler)


async def _refuse(request, context) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "internal port: only the stack's own roles may call it (a valid internal token is required)",
    )


async def _refuse_stream(requests, context) -> None:
    """Refuse a client-streaming call the way every refusal mid-upload is made (`refuse_stream`: say
    so first, let the client stop writing), so the caller sees UNAUTHENTICATED and not a write race."""
    await refuse_stream(requests, context)
    await _refuse(None, context)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call."""
    args = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse, *args)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse, *args)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse_stream, *args)
    return grpc.stream_stream_rpc_method_handler(_refuse_stream, *args)


def server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    return [] if token is None else [TokenInterceptor(token)]


class _AddToken:
    """Adds the token header to a call's metadata (one subclass per kind of call: grpc.aio files an
    interceptor under the first kind it implements only)."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return details._replace(metadata=metadata)


class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def token_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send `token` on every kind of call (none without a token)."""
    kinds = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    return [] if token is None else [kind(token) for kind in kinds]
