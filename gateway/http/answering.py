"""Answering a request: its generations run by the generation core, answered whole or as one stream.

Each choice of each prompt (one prompt, or a completions batch; n choices of each) is a generation of
its own downstream: scheduled, traced and cancelled on its own, with the request's parameters; a
prompt's choices are one prefill group, so the prompt is computed once. All of them are one client
request to the scheduler (`gateway/client_request.py`): they share one batch share of a worker, and the
tenant's token quota admits or refuses them whole, charged once for their summed cost. What the answer
looks like is its shape's: `responses.Answers` (completions and chat completions: one choice per
generation) or `responses_events.Reply` (the Responses API: one generation).

- whole: every generation is awaited; the first failure fails the request with its status, and
  cancels the others;
- streamed: the first event of every generation is awaited before the stream starts, so a prompt
  refused before its first token gives a status (400, 429, 503, ...); then the shape writes the events
  as they come (several generations through one merge, `merged`). A failure after the start is an
  event of the stream.

A client that leaves cancels every generation of the request (`until_disconnected` while they are
awaited, `GenerationStream` once they stream).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loraserve.gateway.client_request import ClientRequest
from loraserve.gateway.core import Call, GenerationCore
from loraserve.gateway.events import Chunk, Event, Summary
from loraserve.gateway.generation_request import Fields
from loraserve.gateway.http.errors import HttpError
from loraserve.gateway.http.generation import (
    CLIENT_CLOSED,
    ClientGone,
    Generation,
    GenerationStream,
    http_metadata,
    until_disconnected,
)
from loraserve.gateway.validation import END_USER_METADATA

T = TypeVar("T")


class Shape(Protocol):
    """What one request's answer looks like (`Answers`, `Reply`): its id, its body (`stream`, `user`), and
    the answer, whole or streamed, or a failure in the API's terms."""

    id: str
    body: Any

    def whole(self, results: list[tuple[Chunk, Summary]]) -> dict[str, Any]: ...

    def stream(self, firsts: list[Event], generations: list[Generation]) -> AsyncIterator[bytes]: ...

    def error(self, exc: BaseException, retry_after_s: float | None = None) -> HttpError: ...


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
        raise shape.error(e, max(hints) if hints else None) from None
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
