"""One generation seen from the HTTP edge: the servicer's own path, run in a task of its own.

`HttpCall` presents a request's headers as the call metadata that path reads (`authorization`,
`traceparent`), and keeps the retry hint of a quota refusal for a Retry-After header. `Generation`
runs `LoraServeService.generate_events` in one task (so the trace span opens and closes in one
context) and hands its events over as plain values: text pieces, then a `Final`. Cancelling it — the
client went away — cancels that task, which cancels the request downstream exactly as a gRPC client's
cancel does; once the summary has come, the task runs the generation to its end (its outcome: OK).
A dropped client is noticed where the request waits: `until_disconnected` watches the
connection while a non-streaming request is generated; Starlette does the same for a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from loraserve.convert import FINISH_REASONS
from loraserve.errors import LoraserveError
from loraserve.gateway.http.responses import FINISH_REASONS as OPENAI_FINISH_REASONS
from loraserve.gateway.http.responses import STREAM_HEADERS, Final, Piece
from loraserve.gateway.service import RETRY_AFTER_KEY
from loraserve.v1 import gateway_pb2

T = TypeVar("T")
_REASON_NAMES = {value: name for name, value in FINISH_REASONS.items()}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class HttpCall:
    """An HTTP request as the generation path sees a call (`gateway.service.CallContext`): its headers,
    and `extra` metadata from its body (which replaces headers of the same name)."""

    def __init__(self, headers: Mapping[str, str], extra: Mapping[str, str] | None = None):
        extra = extra or {}
        headers = [(key.lower(), value) for key, value in headers.items() if key.lower() not in extra]
        self._metadata = (*headers, *extra.items())
        self.retry_after_s: float | None = None

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None  # HTTP carries no deadline; a client that gives up disconnects, which cancels

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        for key, value in metadata:
            if key == RETRY_AFTER_KEY:
                self.retry_after_s = int(value) / 1000


class Generation:
    """The events of one generation, produced by a task of their own: `Piece`s, then a `Final`."""

    def __init__(self, events: AsyncIterator[gateway_pb2.GenerateStreamResponse]):
        self._queue: asyncio.Queue[Piece | Final | Exception] = asyncio.Queue()
        self._finished = False  # the summary came: the generation is over, and ends as OK
        self._task = asyncio.get_running_loop().create_task(self._pump(events))

    async def _pump(self, events: AsyncIterator[gateway_pb2.GenerateStreamResponse]) -> None:
        try:
            async for event in events:  # to its end, past the summary: closing it early would count CANCELLED
                if event.HasField("chunk"):
                    chunk = event.chunk
                    if chunk.text or chunk.logprobs or chunk.prompt_logprobs:
                        self._queue.put_nowait(Piece(chunk.text, list(chunk.logprobs), list(chunk.prompt_logprobs)))
                elif not self._finished:
                    self._finished = True
                    self._queue.put_nowait(_final(event.summary))
            if not self._finished:
                self._queue.put_nowait(LoraserveError("the generation ended without a summary"))
        except Exception as e:  # the request's failure, for the HTTP side to send
            self._queue.put_nowait(e)
        finally:
            await events.aclose()  # here, in this task's context, where its trace span was opened

    async def next(self) -> Piece | Final:
        """The next piece, or the `Final`; raises the generation's failure."""
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def pieces(self) -> AsyncIterator[Piece | Final]:
        """Every event up to and including the `Final`."""
        while True:
            item = await self.next()
            yield item
            if isinstance(item, Final):
                return

    async def collect(self) -> tuple[Piece, Final]:
        """The whole generation: its pieces joined, and how it ended."""
        pieces = []
        async for item in self.pieces():
            if isinstance(item, Final):
                return Piece.joined(pieces), item
            pieces.append(item)
        raise AssertionError("unreachable: pieces() ends with a Final")

    def cancel(self) -> None:
        """Stop generating, which cancels the request downstream; a no-op once the summary has come (what
        remains is the generation's own clean-up, and its outcome is OK)."""
        if not self._finished:
            self._task.cancel()


def _final(summary: gateway_pb2.GenerateResponse) -> Final:
    reason = _REASON_NAMES.get(summary.finish_reason, "stop")
    usage = summary.usage
    return Final(OPENAI_FINISH_REASONS[reason], usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


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
