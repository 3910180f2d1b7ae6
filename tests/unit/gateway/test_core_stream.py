"""The generation core's stream over a real token sink, the scheduler a recording stand-in: the tokens a
worker sends reach the reader in order and whole, one chunk per message while the reader keeps up, and
what already waits behind a reader that fell behind as one chunk (nothing lost, nothing reordered)."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from pathlib import Path
from typing import ClassVar

import grpc
import pytest
from starlette.requests import Request

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import UnavailableError
from loraserve.gateway.auth import Authenticator
from loraserve.gateway.config import GatewayConfig
from loraserve.gateway.core import Call, GenerationCore
from loraserve.gateway.events import Chunk, Summary
from loraserve.gateway.gate import Gate
from loraserve.gateway.generation_request import grpc_fields
from loraserve.gateway.http.answering import answer
from loraserve.gateway.http.drafts import sampling_fields
from loraserve.gateway.http.responses import Answers
from loraserve.gateway.http.schemas import CompletionRequest
from loraserve.gateway.service import GenerationService
from loraserve.gateway.token_sink import TokenSink
from loraserve.gateway.validation import Limits
from loraserve.grpc_utils import ErrorInterceptor
from loraserve.tokenizer import Tokenizer
from loraserve.v1 import gateway_pb2
from loraserve.wire import Tokens

TOKENIZER = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
LIMITS = Limits(vocab_size=1024, max_context=512)
TOKENS = [TOKENIZER.encode(word)[-1] for word in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")]


class Scheduler:
    """Takes every submission (its attempt ids recorded) and every cancel."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.cancelled: list[str] = []

    async def submit(self, attempt_id: str, attempt: int, output_ids: list[int], **_) -> str:
        self.submitted.append(attempt_id)
        return "scheduler-1"

    def cancel(self, request_id: str, reason: str) -> None:
        self.cancelled.append(request_id)

    def hint(self, *_) -> None:
        pass


def run(scenario) -> None:
    async def body() -> None:
        sink = TokenSink("tcp://127.0.0.1:*")
        scheduler = Scheduler()
        core = GenerationCore(GatewayConfig(), LIMITS, TOKENIZER, sink, scheduler, None, Gate(Authenticator()))
        try:
            await scenario(core, sink, scheduler)
        finally:
            sink.shutdown()

    asyncio.run(body())


def generation(core: GenerationCore):
    request = gateway_pb2.GenerateRequest(text="a prompt", max_new_tokens=len(TOKENS))
    request.sampling.ignore_eos = True
    return core.generate(Call({}), lambda: grpc_fields(request))


async def submitted(scheduler: Scheduler, count: int = 1) -> str:
    """The id of the `count`th attempt submitted, once it is."""
    while len(scheduler.submitted) < count:
        await asyncio.sleep(0.001)
    return scheduler.submitted[count - 1]


async def started(core: GenerationCore, scheduler: Scheduler):
    """A generation being read (its first event awaited in a task), and its attempt's id once submitted."""
    events = generation(core)
    first = asyncio.ensure_future(anext(events))
    return events, first, await submitted(scheduler)


def test_a_reader_that_keeps_up_gets_a_chunk_per_message():
    async def scenario(core, sink, scheduler):
        events, first, attempt = await started(core, scheduler)
        chunks = []
        for i, token in enumerate(TOKENS):
            sink._deliver(Tokens(attempt, [token], finished=i == len(TOKENS) - 1, finish_reason="length"))
            chunks.append(await first if i == 0 else await anext(events))
        summary = await anext(events)
        assert [c.token_ids for c in chunks] == [[t] for t in TOKENS]
        assert isinstance(summary, Summary) and summary.completion_tokens == len(TOKENS)

    run(scenario)


def test_a_reader_behind_its_stream_gets_what_waits_as_one_chunk():
    async def scenario(core, sink, scheduler):
        events, first, attempt = await started(core, scheduler)
        sink._deliver(Tokens(attempt, TOKENS[:1]))
        one = await first
        for token in TOKENS[1:4]:  # three messages arrive while the reader is away
            sink._deliver(Tokens(attempt, [token]))
        joined = await anext(events)
        sink._deliver(Tokens(attempt, TOKENS[4:], finished=True, finish_reason="length"))
        last, summary = await anext(events), await anext(events)
        assert one.token_ids == TOKENS[:1] and list(joined.token_ids) == TOKENS[1:4]
        assert joined.text == TOKENIZER.decode(TOKENS[:4])[len(one.text) :]
        assert list(last.token_ids) == TOKENS[4:] and isinstance(summary, Summary)
        assert one.text + joined.text + last.text == TOKENIZER.decode(TOKENS)

    run(scenario)


def test_tokens_waiting_before_a_failure_reach_the_reader_before_it():
    async def scenario(core, sink, scheduler):
        events, first, attempt = await started(core, scheduler)
        sink._deliver(Tokens(attempt, TOKENS[:2]))
        sink._deliver(Tokens(attempt, TOKENS[2:3]))
        sink._deliver(Tokens(attempt, [], finished=True, error_status="UNAVAILABLE", error="it broke"))
        chunk = await first
        assert list(chunk.token_ids) == TOKENS[:3] and isinstance(chunk, Chunk)
        with pytest.raises(UnavailableError, match="it broke"):
            await anext(events)
        assert scheduler.cancelled == [attempt]

    run(scenario)


# ---- the per-token path's depth: async frames between an edge and the attempt's queue -----------------
SHIPPED = tuple(str(Path(__file__).resolve().parents[3] / folder) + os.sep for folder in ("gateway", "loraserve"))


class WatchedQueue(asyncio.Queue):
    """An attempt's queue that records, at each read, the project's async frames the read runs under."""

    chains: ClassVar[list[list[str]]] = []

    async def get(self):
        frame, chain = sys._getframe(1), []
        while frame is not None:
            code = frame.f_code
            if code.co_flags & (inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR) and code.co_filename.startswith(
                SHIPPED
            ):
                chain.append(code.co_qualname)
            frame = frame.f_back
        WatchedQueue.chains.append(chain)
        return await super().get()


def watched(sink: TokenSink) -> None:
    def open_watched(request_id: str) -> WatchedQueue:
        queue = sink._streams[request_id] = WatchedQueue()
        return queue

    sink.open = open_watched


class Context:
    """The parts of a gRPC servicer context the generation RPCs read."""

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None


def test_a_token_crosses_four_async_frames_on_either_edge():
    async def scenario(core, sink, scheduler):
        watched(sink)

        async def handler(_details):
            return grpc.unary_stream_rpc_method_handler(GenerationService(core).GenerateStream)

        served = await ErrorInterceptor().intercept_service(handler, None)
        request = gateway_pb2.GenerateRequest(text="a prompt", max_new_tokens=2)
        responses = served.unary_stream(request, Context())
        first = asyncio.ensure_future(anext(responses))
        attempt = await submitted(scheduler)
        sink._deliver(Tokens(attempt, TOKENS[:1]))
        assert (await first).chunk.token_ids == TOKENS[:1]
        grpc_chain = WatchedQueue.chains[-1]

        drafts = [{"adapter": "", "prompt_text": "a prompt", "sampling": sampling_fields({}, 2)}]
        reading = asyncio.ensure_future(answer(core, drafts, Answers("cmpl-1", STREAMED), Request(HTTP_SCOPE, _silent)))
        attempt = await submitted(scheduler, 2)
        sink._deliver(Tokens(attempt, TOKENS[:1]))
        stream = await reading  # its first piece was read before the response began
        sink._deliver(Tokens(attempt, TOKENS[1:2]))
        events = [await anext(stream.body_iterator), await anext(stream.body_iterator)]
        assert all(event.startswith(b"data: ") for event in events)
        http_chain = WatchedQueue.chains[-1]
        assert grpc_chain == [
            "FailoverStream.messages",
            "GenerationCore.generate",
            "GenerationService.GenerateStream",
            "_wrap_stream.<locals>.wrapper",
        ]
        assert http_chain == ["FailoverStream.messages", "GenerationCore.generate", "Generation.next", "Answers.stream"]

    run(scenario)


STREAMED = CompletionRequest(model="m", prompt="a prompt", stream=True)
HTTP_SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}


async def _silent() -> dict:
    """A client that never disconnects."""
    await asyncio.Event().wait()
    return {}
