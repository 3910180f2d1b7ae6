"""Client-streaming calls across roles: refusing one mid-upload, and relaying one to another role.

A server that refuses an upload says so first (`refuse_stream`: initial metadata, then it drains what the
client still sends), and a relay (`forward_stream`) stops writing the moment that refusal arrives, so the
caller sees the refusal's status and never a write race.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from loraserve import errors

log = logging.getLogger(__name__)

REFUSED_KEY = "loraserve-refused"  # initial metadata a server sends the moment it refuses a request stream
REFUSAL_DRAIN_S = 0.5  # how long a refusing server keeps reading, waiting for the client to stop...
REFUSAL_DRAIN_BYTES = 4 * 2**20  # ...and how much it reads at most


async def refuse_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
    """Before failing a client-streaming call mid-stream: say so, and let the client stop sending.

    A server that ends a call while the client is still writing races with that write, and when
    the write loses, grpc.aio clients (our gateway among them) replace the server's status with
    INTERNAL "Internal error from Core". So the refusing handler first sends initial metadata
    (`forward_stream` stops relaying when it arrives), then reads and drops what is still coming
    until the client half-closes, for a bounded time and size, and only then raises its error.
    """
    try:
        await context.send_initial_metadata(((REFUSED_KEY, "1"),))
        async with asyncio.timeout(REFUSAL_DRAIN_S):
            await _drain(requests, REFUSAL_DRAIN_BYTES)
    except (TimeoutError, errors.LoraserveError, grpc.aio.AbortError):
        pass  # a client that keeps sending (or sends garbage) gets the status now regardless
    except Exception as e:  # never let the courtesy hide the real error
        log.debug("draining a refused stream failed: %r", e)


async def _drain(requests: AsyncIterator[Any], max_bytes: int) -> None:
    seen = 0
    async for request in requests:
        seen += request.ByteSize() if hasattr(request, "ByteSize") else len(request)
        if seen > max_bytes:
            return


async def forward_stream(
    method: grpc.aio.StreamUnaryMultiCallable,
    requests: AsyncIterator[Any],
    timeout: float,
    metadata: Any = None,
) -> Any:
    """Relay a client's request stream to another role's stream-unary RPC; returns its response.

    The relay reads the client's stream itself rather than handing the iterator to grpc: when the
    client's stream fails (an undecodable message, a cancel), grpc's own pump would swallow the
    error and leave the upstream call waiting for messages until its timeout; here the upstream
    call is cancelled at once and the client's error raised. When the upstream refuses (initial
    metadata before any response, see `refuse_stream`), relaying stops and its status is raised.
    """
    call = method(timeout=timeout, metadata=metadata)
    answered = asyncio.ensure_future(call.initial_metadata())  # only a refusal answers mid-stream
    try:
        await _relay(requests, call, answered)
    except BaseException:
        call.cancel()
        raise
    finally:
        answered.cancel()
    return await call


async def _relay(requests: AsyncIterator[Any], call: grpc.aio.StreamUnaryCall, answered: asyncio.Future) -> None:
    try:
        async for request in requests:
            if answered.done() or call.done():
                break
            await call.write(request)
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the upstream call ended while we wrote: awaiting it gives its status
