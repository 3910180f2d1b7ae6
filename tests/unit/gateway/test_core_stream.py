"""The generation core's stream over a real token sink, the scheduler a recording stand-in: the tokens a
worker sends reach the reader in order and whole, one chunk per message while the reader keeps up, and
what already waits behind a reader that fell behind as one chunk (nothing lost, nothing reordered)."""

from __future__ import annotations

import asyncio

import pytest

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import UnavailableError
from loraserve.gateway.auth import Authenticator
from loraserve.gateway.config import GatewayConfig
from loraserve.gateway.core import Call, GenerationCore
from loraserve.gateway.events import Chunk, Summary
from loraserve.gateway.gate import Gate
from loraserve.gateway.token_sink import TokenSink
from loraserve.gateway.validation import Limits, validate_generate
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
    return core.generate(Call({}), lambda check: validate_generate(request, LIMITS, check))


async def started(core: GenerationCore, scheduler: Scheduler):
    """A generation being read (its first event awaited in a task), and its attempt's id once submitted."""
    events = generation(core)
    first = asyncio.ensure_future(anext(events))
    while not scheduler.submitted:
        await asyncio.sleep(0.001)
    return events, first, scheduler.submitted[-1]


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
