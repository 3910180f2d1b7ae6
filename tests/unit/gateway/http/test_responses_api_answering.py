"""Answering a Responses API request (`answering.answer` with a `Reply`) over a scripted generation core, without
processes: a client that leaves cancels the generation, whole or streamed, and a request refused before its
first token is an HTTP error naming the Responses API's parameter."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from loraserve.errors import InvalidRequestError
from loraserve.gateway.events import Chunk
from loraserve.gateway.http.answering import CLIENT_CLOSED, GenerationStream
from loraserve.gateway.http.answering import answer as respond
from loraserve.gateway.http.errors import HttpError
from loraserve.gateway.http.responses_events import Reply
from loraserve.gateway.http.schemas import ResponsesRequest

SCOPE = {"type": "http", "method": "POST", "path": "/v1/responses", "headers": [], "query_string": b""}


class EndlessCore:
    """A generation core whose generations write text until cancelled (or fail at once, with `failure`)."""

    limits = SimpleNamespace()

    def __init__(self, failure: Exception | None = None):
        self.failure = failure
        self.cancelled = asyncio.Event()
        self.chunks = 0

    def generate(self, call, validate):
        async def events():
            if self.failure is not None:
                raise self.failure
            try:
                while True:
                    await asyncio.sleep(0.001)
                    self.chunks += 1
                    yield Chunk("x", (1,), prompt_tokens=3)
            except (asyncio.CancelledError, GeneratorExit):  # cancelled while reading, or closed (as the core is)
                self.cancelled.set()
                raise

        return events()


def leaving_after(seconds: float):
    """An ASGI `receive` whose client disconnects after `seconds`."""

    async def receive():
        await asyncio.sleep(seconds)
        return {"type": "http.disconnect"}

    return receive


def answer(core: EndlessCore, stream: bool, receive) -> object:
    reply = Reply("resp_1", ResponsesRequest(model="m", input="the quiet king", stream=stream))
    return respond(core, [{"adapter": ""}], reply, Request(SCOPE, receive))


def test_a_client_that_leaves_a_whole_answer_cancels_its_generation():
    async def run() -> None:
        core = EndlessCore()
        response = await answer(core, False, leaving_after(0.05))
        assert response.status_code == CLIENT_CLOSED
        await asyncio.wait_for(core.cancelled.wait(), 5)

    asyncio.run(run())


def test_a_client_that_leaves_a_stream_cancels_its_generation():
    async def run() -> None:
        core = EndlessCore()
        receive = leaving_after(0.05)
        response = await answer(core, True, receive)
        assert isinstance(response, GenerationStream)
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await asyncio.wait_for(response(SCOPE, receive, send), 5)
        await asyncio.wait_for(core.cancelled.wait(), 5)
        assert sent[0]["status"] == 200 and b"event: response.output_text.delta" in sent[-1]["body"]
        chunks = core.chunks
        await asyncio.sleep(0.05)
        assert core.chunks == chunks  # nothing more is generated

    asyncio.run(run())


@pytest.mark.parametrize("stream", [True, False])
def test_a_refusal_before_the_first_token_is_an_http_error_naming_the_responses_parameter(stream):
    async def run() -> None:
        core = EndlessCore(InvalidRequestError("max_new_tokens", "leaves no room for a prompt"))
        with pytest.raises(HttpError) as refused:
            await answer(core, stream, leaving_after(60))
        assert refused.value.status == 400 and refused.value.body["error"]["param"] == "max_output_tokens"

    asyncio.run(run())
