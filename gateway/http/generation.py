"""One generation seen from the HTTP edge: the generation core's own events (`gateway/events.py`), read as
they are asked for.

`http_metadata` presents a request's headers as the call metadata the core reads (`authorization`,
`traceparent`). `Generation` reads `GenerationCore.generate` directly, in whichever task asks for its
next event (no task or queue of its own): `Chunk`s with text or log-probabilities (a chunk with neither is
joined to the next, so its tokens still count), then the `Summary`; a refusal's retry hint is kept for a
Retry-After header. Once the summary has come it reads the core's events to their end (its outcome: OK).
`close` stops it early — the client went away — which cancels the request downstream exactly as a gRPC
client's cancel does; a reader of a closed generation gets `GenerationCancelled`.
A dropped client is noticed where the request waits: `until_disconnected` watches the connection while
a request is generated before its answer begins (cancelling the read cancels the generation);
Starlette does the same for a stream, and `GenerationStream` closes its generations however the
response ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from loraserve.errors import LoraserveError
from loraserve.gateway.events import Chunk, Event, RetryLaterError, Summary

T = TypeVar("T")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # nginx's status for a client that went away; nobody reads it, the log does


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class GenerationCancelled(LoraserveError):
    """What a reader of a generation cancelled before its end gets (instead of waiting forever)."""

    status = "CANCELLED"


def http_metadata(headers: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An HTTP request as call metadata: its headers (lower-case names), and `extra` metadata from its
    body (which replaces headers of the same name)."""
    return {key.lower(): value for key, value in headers.items()} | dict(extra or {})


class Generation:
    """The events of one generation, read from the core as they are asked for."""

    def __init__(self, events: AsyncIterator[Event]):
        self._events = events
        self._closed = False
        self.retry_after_s: float | None = None  # a refusal's hint of when to retry

    async def next(self) -> Event:
        """The next chunk with text or log-probabilities, or the summary; raises the generation's failure."""
        if self._closed:
            raise GenerationCancelled("the generation was cancelled")
        silent: list[Chunk] = []  # chunks with tokens alone, joined to the next
        try:
            while (event := await anext(self._events, None)) is not None:
                if isinstance(event, Summary):
                    await anext(self._events, None)  # past the summary, to its end: its outcome is OK
                    return event
                if event.text or event.logprobs or event.prompt_logprobs:
                    return Chunk.joined([*silent, event]) if silent else event
                silent.append(event)
        except RetryLaterError as e:
            self.retry_after_s = e.retry_after_ms / 1000
            raise
        raise LoraserveError("the generation ended without a summary")

    async def collect(self) -> tuple[Chunk, Summary]:
        """The whole generation: its chunks joined, and its summary."""
        chunks = []
        while not isinstance(event := await self.next(), Summary):
            chunks.append(event)
        return Chunk.joined(chunks) if chunks else Chunk(""), event

    async def close(self) -> None:
        """Stop generating, which cancels the request downstream; a no-op once it has ended (a generation read
        past its summary ended OK)."""
        self._closed = True
        await self._events.aclose()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client disconnects first.

    The request body must have been read: what `receive` gives after it is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GenerationStream(StreamingResponse):
    """The SSE response of one or more generations, which it cancels when the response ends in any way.

    A client that disconnects makes Starlette cancel the task sending the stream. That task may be
    waiting in `send` rather than in the events generator, and then the generator is only closed
    when it is garbage-collected: closing the generations here, as the response itself ends,
    does not depend on where the cancellation landed."""

    def __init__(self, generations: list[Generation], events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream", headers=STREAM_HEADERS)
        self.generations = generations

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # first: a merge of several generations stops reading them
            for generation in self.generations:
                await generation.close()
