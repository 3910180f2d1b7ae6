"""Answering a request: its generations run by the generation core, answered whole or as one stream.

Each choice of each prompt is a generation of its own downstream (scheduled, traced and cancelled on
its own); a prompt's choices are one prefill group, so the prompt is computed once. All of them are one
client request to the scheduler (`gateway/client_request.py`): one batch share of a worker, admitted or
refused whole by the tenant's token quota. The answer's shape is `responses.Answers` (completions and
chat completions: one choice per generation) or `responses_events.Reply` (the Responses API).

- whole: every generation is awaited; the first failure fails the request with its status, and
  cancels the others;
- streamed: the first event of every generation is awaited before the stream starts, so a prompt
  refused before its first token gives a status (400, 429, 503, ...); a failure after the start is an
  event of the stream.

A client that leaves cancels every generation of the request: `until_disconnected` watches the
connection while they are awaited, and `GenerationStream` closes them however a stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from loraserve.errors import LoraserveError
from loraserve.gateway.client_request import ClientRequest
from loraserve.gateway.core import Call, GenerationCore
from loraserve.gateway.events import Chunk, Event, RetryLaterError, Summary
from loraserve.gateway.generation_request import Fields
from loraserve.gateway.http.errors import http_error
from loraserve.gateway.validation import END_USER_METADATA

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
    """The events of one generation (`gateway/events.py`), read from the core in whichever task asks for the
    next one (no task or queue of its own). `close` cancels the request downstream, as a gRPC client's
    cancel does; a reader of a closed generation gets `GenerationCancelled`."""

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
            await _close(self.generations)


class Shape(Protocol):
    """What one request's answer looks like (`Answers`, `Reply`): its id, its body (`stream`, `user`), the
    API's names for the core's fields (`errors.PARAMS`, ...), and the answer, whole or streamed."""

    id: str
    body: Any
    params: Mapping[str, str]

    def whole(self, results: list[tuple[Chunk, Summary]]) -> dict[str, Any]: ...

    def stream(self, firsts: list[Event], generations: list[Generation]) -> AsyncIterator[bytes]: ...


async def answer(core: GenerationCore, drafts: list[Fields], shape: Shape, request: Request) -> Response:
    """The response to `drafts`, prompt by prompt (each prompt's choices, or best_of's candidates, in a row),
    shaped by `shape`; the body's `user` (OpenAI's end user) goes on each generation's trace."""
    user = shape.body.user
    metadata = http_metadata(request.headers, {END_USER_METADATA: user} if user else None)
    whole = ClientRequest(shape.id, len(drafts)) if len(drafts) > 1 else None  # one batch share, one charge
    generations = []
    for index, draft in enumerate(drafts):  # on the request's trace, beside loraserve's own id
        named = {**draft, "client_request_id": shape.id if len(drafts) == 1 else f"{shape.id}-{index}"}
        call = Call(metadata, client_request_id=named["client_request_id"], request=whole)
        generations.append(Generation(core.generate(call, named.copy)))
    try:
        if not shape.body.stream:
            results = await until_disconnected(request, _all([g.collect() for g in generations]))
            return JSONResponse(shape.whole(results))
        firsts = await until_disconnected(request, _all([g.next() for g in generations]))
    except ClientGone:
        await _close(generations)
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:
        await _close(generations)
        hints = [g.retry_after_s for g in generations if g.retry_after_s is not None]
        raise http_error(e, shape.params, max(hints) if hints else None) from None
    return GenerationStream(generations, shape.stream(firsts, generations))


async def _all(reads: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every read's result, in order. At the first failure (or when cancelled) the other reads are
    cancelled and awaited before it is raised: none is left waiting on a generation nobody answers,
    to be collected later while suspended in it (asyncio then logs "aclose(): asynchronous generator
    is already running" for the generators it was in)."""
    tasks = [asyncio.ensure_future(read) for read in reads]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(generations: list[Generation]) -> None:
    for generation in generations:
        await generation.close()


async def merged(firsts: list[Event], generations: list[Generation]) -> AsyncIterator[tuple[int, Event]]:
    """(generation index, event) of every generation as they come, each generation's up to its summary:
    pumped into one queue by a task each."""
    queue: asyncio.Queue[tuple[int, Event | Exception]] = asyncio.Queue()

    async def pump(index: int, event: Event) -> None:
        try:
            while not isinstance(event, Summary):
                await queue.put((index, event))
                event = await generations[index].next()
            await queue.put((index, event))
        except Exception as e:
            await queue.put((index, e))

    pumps = [asyncio.create_task(pump(i, first)) for i, first in enumerate(firsts)]
    try:
        running = len(generations)
        while running:  # until every generation's summary
            index, event = await queue.get()
            if isinstance(event, Exception):
                raise event
            yield index, event
            running -= isinstance(event, Summary)
    finally:
        for task in pumps:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps, return_exceptions=True)
