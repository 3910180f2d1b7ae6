"""A completions request with several prompts: one generation per prompt, answered as one.

Each prompt is a request of its own downstream (scheduled, quota-counted, traced and cancelled on
its own), with the request's parameters. The answer has one choice per prompt, `index` = the
prompt's place in the list, and the usage summed:

- whole: every generation is awaited; the first failure fails the request with its status, and
  cancels the others;
- streamed: the first event of every generation is awaited before the stream starts (so a prompt
  that is refused gives a status, as with one prompt); then the generations' chunks are sent as
  they come, interleaved, each generation closing with its own finish chunk, then the summed usage
  (with `include_usage`) and `[DONE]`. A failure after the start is an error event.

A client that leaves cancels every generation of the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loraserve.gateway.http.errors import http_error
from loraserve.gateway.http.generation import ClientGone, Generation, GenerationStream, HttpCall, until_disconnected
from loraserve.gateway.http.responses import CLIENT_CLOSED, DONE, Answers, Final, sse
from loraserve.gateway.service import LoraServeService
from loraserve.v1 import gateway_pb2


async def answer_batch(
    service: LoraServeService,
    generates: list[gateway_pb2.GenerateRequest],
    answers: Answers,
    request: Request,
    stream: bool,
) -> Response:
    calls = [HttpCall(request.headers) for _ in generates]
    for index, generate in enumerate(generates):
        generate.client_request_id = f"{answers.id}-{index}"
    generations = [Generation(service.generate_events(g, c)) for g, c in zip(generates, calls, strict=True)]
    try:
        if not stream:
            results = await until_disconnected(request, asyncio.gather(*(g.collect() for g in generations)))
            return JSONResponse(answers.whole_batch(list(results)))
        firsts = await until_disconnected(request, asyncio.gather(*(g.next() for g in generations)))
    except ClientGone:
        _cancel(generations)
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:
        _cancel(generations)
        hints = [c.retry_after_s for c in calls if c.retry_after_s is not None]
        raise http_error(e, "prompt", max(hints) if hints else None) from None
    return GenerationStream(generations, _events(list(firsts), generations, answers))


def _cancel(generations: list[Generation]) -> None:
    for generation in generations:
        generation.cancel()


async def _events(firsts: list[str | Final], generations: list[Generation], answers: Answers) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[tuple[int, str | Final | Exception]] = asyncio.Queue()

    async def pump(index: int, item: str | Final) -> None:
        try:
            while not isinstance(item, Final):
                await queue.put((index, item))
                item = await generations[index].next()
            await queue.put((index, item))
        except Exception as e:
            await queue.put((index, e))

    pumps = [asyncio.create_task(pump(i, first)) for i, first in enumerate(firsts)]
    try:
        finals: dict[int, Final] = {}
        while len(finals) < len(generations):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Final):
                finals[index] = item
                yield sse(answers.closing(item, index))
            else:
                yield sse(answers.piece(item, index))
        if answers.include_usage:
            yield sse(answers.usage(Final.summed(list(finals.values()))))
    except Exception as e:  # after the status line: the failure goes in the stream
        yield sse(http_error(e).body)
    finally:
        for task in pumps:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps, return_exceptions=True)
    yield DONE
