"""One generation seen from the HTTP edge: the generation core's events, run in a task of their own.

`http_metadata` presents a request's headers as the call metadata the core reads (`authorization`,
`traceparent`). `Generation` runs `GenerationCore.generate` in one task (so the trace span opens and
closes in one context) and hands its events over as plain values: text pieces, then a `Final`; a
refusal's retry hint is kept for a Retry-After header. Cancelling it — the client went away —
cancels that task, which cancels the request downstream exactly as a gRPC client's cancel does; once
the summary has come, the task runs the generation to its end (its outcome: OK). A reader of a
generation cancelled before its end gets `GenerationCancelled`, never waits forever.
A dropped client is noticed where the request waits: `until_disconnected` watches the
connection while a non-streaming request is generated; Starlette does the same for a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from loraserve.errors import LoraserveError
from loraserve.gateway.events import Chunk, Event, RetryLaterError, Summary
from loraserve.gateway.http.responses import FINISH_REASONS as OPENAI_FINISH_REASONS
from loraserve.gateway.http.responses import STREAM_HEADERS, Final, Piece

T = TypeVar("T")


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
    """The events of one generation, produced by a task of their own: `Piece`s, then a `Final`."""

    def __init__(self, events: AsyncIterator[Event]):
        self._queue: asyncio.Queue[Piece | Final | Exception] = asyncio.Queue()
        self._finished = False  # the summary came: the generation is over, and ends as OK
        self.retry_after_s: float | None = None  # a refusal's hint of when to retry
        self._task = asyncio.get_running_loop().create_task(self._pump(events))
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """Cancelled (even before it ran): whoever still reads it learns so, and is not left waiting forever."""
        if task.cancelled():
            self._queue.put_nowait(GenerationCancelled("the generation was cancelled"))

    async def _pump(self, events: AsyncIterator[Event]) -> None:
        generated = 0  # tokens so far, shown or not (a piece's usage counts them all)
        try:
            async for event in events:  # to its end, past the summary: closing it early would count CANCELLED
                if isinstance(event, Chunk):
                    generated += len(event.token_ids)
                    if event.text or event.logprobs or event.prompt_logprobs:
                        usage = Final("", event.prompt_tokens, generated, event.cached_tokens)
                        self._queue.put_nowait(Piece(event.text, event.logprobs, event.prompt_logprobs, usage))
                elif not self._finished:
                    self._finished = True
                    self._queue.put_nowait(_final(event))
            if not self._finished:
                self._queue.put_nowait(LoraserveError("the generation ended without a summary"))
        except Exception as e:  # the request's failure, for the HTTP side to send
            if isinstance(e, RetryLaterError):
                self.retry_after_s = e.retry_after_ms / 1000
            self._queue.put_nowait(e)
        finally:
            await events.aclose()  # here, in this task's context, where its trace span was opened

    async def next(self) -> Piece | Final:
        """The next piece, or the `Final`; raises the generation's failure."""
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def collect(self) -> tuple[Piece, Final]:
        """The whole generation: its pieces joined, and how it ended."""
        pieces = []
        while not isinstance(item := await self.next(), Final):
            pieces.append(item)
        return Piece.joined(pieces), item

    def cancel(self) -> None:
        """Stop generating, which cancels the request downstream; a no-op once the summary has come (what
        remains is the generation's own clean-up, and its outcome is OK)."""
        if not self._finished:
            self._task.cancel()


def _final(summary: Summary) -> Final:
    reason = summary.finish_reason if summary.finish_reason in OPENAI_FINISH_REASONS else "stop"
    return Final(OPENAI_FINISH_REASONS[reason], summary.prompt_tokens, summary.completion_tokens, summary.cached_tokens)


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
    when it is garbage-collected: cancelling the generations here, as the response itself ends,
    does not depend on where the cancellation landed."""

    def __init__(self, generations: list[Generation], events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream", headers=STREAM_HEADERS)
        self.generations = generations

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self.generations:
                generation.cancel()
