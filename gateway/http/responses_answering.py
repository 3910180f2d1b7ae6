"""Answering a Responses API request: its one generation, answered whole or as a stream of events.

The generation runs as a chat completion's does (`generation.Generation` over the generation core). Whole,
it is awaited and answered as one response object; streamed, its first event is awaited before the
stream starts, so a request refused before its first token gets a status (400, 429, 503, ...), then the
events of `responses_events.py` are sent as the text comes. A failure after the stream began is an
`error` event, which ends the stream. A client that leaves cancels the generation (`until_disconnected`
while it is awaited, `GenerationStream` once it streams). Failures name the Responses API's parameters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

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
from loraserve.gateway.http.responses import CLIENT_CLOSED, Final, Piece
from loraserve.gateway.http.responses_api import renamed
from loraserve.gateway.http.responses_events import Reply, ResponseEvents, sse
from loraserve.gateway.validation import END_USER_METADATA

PROMPT_PARAM = "input"  # what a prompt problem names


async def respond(
    core: GenerationCore, draft: Fields, reply: Reply, request: Request, stream: bool, end_user: str | None = None
) -> Response:
    """The response to `draft`, shaped by `reply`; `end_user` (OpenAI's `user`) goes on the generation's trace."""
    metadata = http_metadata(request.headers, {END_USER_METADATA: end_user} if end_user else None)
    named = {**draft, "client_request_id": reply.id}
    generation = Generation(core.generate(Call(metadata, client_request_id=reply.id), named.copy))
    try:
        if not stream:
            piece, final = await until_disconnected(request, generation.collect())
            return JSONResponse(reply.whole(piece.text, final))
        first = await until_disconnected(request, generation.next())
    except ClientGone:
        await generation.close()
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:
        await generation.close()
        raise renamed(http_error(e, PROMPT_PARAM, generation.retry_after_s)) from None
    return GenerationStream([generation], events(first, generation, reply))


async def events(first: Piece | Final, generation: Generation, reply: Reply) -> AsyncIterator[bytes]:
    """The SSE stream, from the generation's first event on (`GenerationStream` stops the generation after it)."""
    made = ResponseEvents(reply)
    try:
        for event in made.opening():
            yield sse(event)
        texts, item = [], first
        while not isinstance(item, Final):
            texts.append(item.text)
            if item.text and not reply.buffered:
                yield sse(made.text_delta(0, item.text))
            item = await generation.next()
        output = reply.output("".join(texts), item)
        for event in [*made.settled(output), made.closing(output, item)]:
            yield sse(event)
    except Exception as e:  # after the status line: the failure goes in the stream, and ends it
        yield sse(made.error(renamed(http_error(e, PROMPT_PARAM)).body))
