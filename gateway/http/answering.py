"""Answering a completions or chat request: one generation per choice, answered as one response.

Each choice of each prompt (one prompt, or a completions batch; n choices of each) is a generation of
its own downstream: scheduled, traced and cancelled on its own, with the request's parameters; a
prompt's choices are one prefill group, so the prompt is computed once. All of them are one client
request to the scheduler (`gateway/client_request.py`): they share one batch share of a worker, and the
tenant's token quota admits or refuses them whole, charged once for their summed cost. The answer has
one choice per generation, `index` = prompt's place × n + the choice's, and the usage summed (each
prompt's tokens once). With best_of above n, each prompt runs best_of candidates and the n with the
highest log-probability are answered, likeliest first; the usage counts every candidate's tokens.

- whole: every generation is awaited; the first failure fails the request with its status, and
  cancels the others;
- streamed: the first event of every generation is awaited before the stream starts, so a prompt
  refused before its first token gives a status (400, 429, 503, ...); then the chunks are sent as
  they come (a batch's interleaved, each prompt closing with its own finish chunk), then the
  summed usage with `include_usage`, and `[DONE]`. A failure after the start is an error event.

A client that leaves cancels every generation of the request (`GenerationStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loraserve.gateway.client_request import ClientRequest
from loraserve.gateway.core import Call, GenerationCore
from loraserve.gateway.generation_request import Fields
from loraserve.gateway.http.errors import http_error
from loraserve.gateway.http.generation import (
    ClientGone,
    Generation,
    GenerationStream,
    http_metadata,
    until_disconnected,
)
from loraserve.gateway.http.responses import CLIENT_CLOSED, DONE, Answers, Final, Piece, sse
from loraserve.gateway.validation import END_USER_METADATA

T = TypeVar("T")


async def answer(
    core: GenerationCore,
    drafts: list[Fields],
    answers: Answers,
    request: Request,
    stream: bool,
    prompt_param: str,
    candidates: int = 1,
    end_user: str | None = None,
) -> Response:
    """The response to `drafts` (`candidates` per prompt, prompt by prompt: one per choice, or
    best_of's candidates, of which the n likeliest are answered). `prompt_param` is what a prompt
    problem names; `end_user` (OpenAI's `user`) goes on each generation's trace."""
    metadata = http_metadata(request.headers, {END_USER_METADATA: end_user} if end_user else None)
    whole = ClientRequest(answers.id, len(drafts)) if len(drafts) > 1 else None  # one batch share, one charge
    generations = []
    for index, draft in enumerate(drafts):  # on the request's trace, beside loraserve's own id
        named = {**draft, "client_request_id": answers.id if len(drafts) == 1 else f"{answers.id}-{index}"}
        call = Call(metadata, client_request_id=named["client_request_id"], request=whole)
        generations.append(Generation(core.generate(call, named.copy)))
    try:
        if not stream:
            results = await until_disconnected(request, _all([g.collect() for g in generations]))
            usage = Final.summed([final for _, final in results], candidates)
            kept = best_of(list(results), candidates, answers.choices_per_prompt)
            return JSONResponse(answers.whole(kept, usage))
        firsts = await until_disconnected(request, _all([g.next() for g in generations]))
    except ClientGone:
        await _close(generations)
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:
        await _close(generations)
        hints = [g.retry_after_s for g in generations if g.retry_after_s is not None]
        raise http_error(e, prompt_param, max(hints) if hints else None) from None
    return GenerationStream(generations, _events(list(firsts), generations, answers))


def best_of(results: list[tuple[Piece, Final]], candidates: int, n: int) -> list[tuple[Piece, Final]]:
    """Of each prompt's `candidates` results (consecutive), the `n` with the highest log-probability
    (the sum of their tokens'), likeliest first; all of them, in order, when there are only n."""
    if candidates == n:
        return results
    kept = []
    for start in range(0, len(results), candidates):
        block = results[start : start + candidates]
        ranked = sorted(block, key=lambda result: -sum(e.logprob for e in result[0].logprobs))
        kept += ranked[:n]
    return kept


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


async def _events(firsts: list[Piece | Final], generations: list[Generation], answers: Answers) -> AsyncIterator[bytes]:
    """The SSE stream, from the generations' first events on (`GenerationStream` stops them after it). A lone
    generation is read here, in the response's task; several through one merge."""
    written = _Written(answers)
    try:
        for index in range(len(generations)):  # chat: each choice's role
            opening = answers.opening(firsts[index], index)
            if opening is not None:
                yield sse(opening)
        if len(generations) == 1:
            item, generation = firsts[0], generations[0]
            while True:
                for event in written.of(0, item):
                    yield event
                if isinstance(item, Final):
                    break
                item = await generation.next()
        else:
            async for index, item in _merged(firsts, generations):
                for event in written.of(index, item):
                    yield event
        if answers.include_usage:
            yield sse(answers.usage(Final.summed(written.finals(), answers.choices_per_prompt)))
    except Exception as e:  # after the status line: the failure goes in the stream
        yield sse(http_error(e).body)
    yield DONE


class _Written:
    """What each generation's events become on the stream: pieces as they come (or held until the choice
    ends, for an answer that is only sent whole), then its closing chunk."""

    def __init__(self, answers: Answers):
        self.answers = answers
        self._finals: dict[int, Final] = {}
        self._started: set[int] = set()  # the choices whose first piece was sent
        self._held: dict[int, list[Piece]] = {}  # a buffered answer's pieces, per prompt

    def of(self, index: int, generated: Piece | Final) -> list[bytes]:
        """The SSE events for one event of generation `index`."""
        answers, item = self.answers, self.answers.shown(generated)
        if isinstance(item, Piece) and not (item.text or item.logprobs or item.prompt_logprobs):
            return []  # all of it left out (`prompt_only`)
        if isinstance(item, Final):
            self._finals[index] = item
            if answers.buffered:
                return [sse(c) for c in answers.settled(Piece.joined(self._held.pop(index, [])), item, index)]
            return [sse(answers.closing(item, index, first=index not in self._started))]
        if answers.buffered:
            self._held.setdefault(index, []).append(item)
            return []
        first = index not in self._started
        self._started.add(index)
        return [sse(answers.piece(item, index, first=first))]

    def finals(self) -> list[Final]:
        """Every generation's Final, in order."""
        return [self._finals[i] for i in sorted(self._finals)]


async def _merged(
    firsts: list[Piece | Final], generations: list[Generation]
) -> AsyncIterator[tuple[int, Piece | Final]]:
    """(prompt index, event) of every generation as they come, each generation's up to its Final: pumped
    into one queue by a task each."""
    queue: asyncio.Queue[tuple[int, Piece | Final | Exception]] = asyncio.Queue()

    async def pump(index: int, item: Piece | Final) -> None:
        try:
            while not isinstance(item, Final):
                await queue.put((index, item))
                item = await generations[index].next()
            await queue.put((index, item))
        except Exception as e:
            await queue.put((index, e))

    pumps = [asyncio.create_task(pump(i, first)) for i, first in enumerate(firsts)]
    try:
        running = len(generations)
        while running:  # until every generation's Final
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield index, item
            running -= isinstance(item, Final)
    finally:
        for task in pumps:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps, return_exceptions=True)
