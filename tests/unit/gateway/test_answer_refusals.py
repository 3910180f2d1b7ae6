"""A request of several choices, one of them refused, leaves nothing behind in the gateway.

`answering.answer` reads every choice's generation; when one is refused (over the tenant's
`max_concurrent`, an invalid request) the others are cancelled. The tasks that were reading them
must end too: left waiting on a generation nobody answers any more, they are collected later while
suspended inside it, and asyncio then logs "aclose(): asynchronous generator is already running"
(and "Task was destroyed but it is pending!") into the gateway's log. Run here on the real
`answer`, `Generation` and `until_disconnected`, with generations scripted in place of the core's.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator

import pytest

from loraserve.errors import InvalidRequestError
from loraserve.gateway.events import Chunk, Event
from loraserve.gateway.http.answering import answer
from loraserve.gateway.http.errors import HttpError
from loraserve.gateway.http.responses import Answers
from loraserve.gateway.http.schemas import CompletionRequest
from loraserve.gateway.slots import SlotLimitError
from loraserve.gateway.validation import Limits


class ScriptedCore:
    """The generation core's `generate`, scripted: the last choice is refused, the others stream slowly."""

    def __init__(self, refusal: Exception):
        self.limits = Limits(vocab_size=1024, max_context=512)
        self.refusal = refusal
        self.calls = 0

    async def generate(self, call, validate) -> AsyncIterator[Event]:
        self.calls += 1
        if self.calls == 3:
            raise self.refusal
        yield Chunk("a")
        await asyncio.sleep(3600)  # still generating when the refusal comes


class Connected:
    """An HTTP request whose client stays connected."""

    def __init__(self) -> None:
        self.headers = {"authorization": "Bearer key"}

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "refusal",
    [lambda: SlotLimitError("over max_concurrent", 0.5), lambda: InvalidRequestError("max_new_tokens", "too many")],
    ids=["quota", "invalid"],
)
def test_a_refused_choice_leaves_no_reader_behind_and_nothing_in_the_log(caplog, stream, refusal):
    async def request() -> int:  # one HTTP request: answered, and everything it held dropped
        body = CompletionRequest(model="m", prompt="the quiet king", n=3, stream=stream)
        drafts, answers = [{"adapter": "", "prompt_text": "the quiet king"}] * 3, Answers("c-1", body)
        try:
            await answer(ScriptedCore(refusal()), drafts, answers, Connected())
        except HttpError as e:
            return e.status
        raise AssertionError("a choice was refused: the request must fail")

    async def scenario() -> int:
        status = await request()
        for _ in range(3):  # what the request left behind is collected, as the gateway's GC would
            await asyncio.sleep(0.05)
            gc.collect()
        await asyncio.sleep(0.05)
        assert asyncio.all_tasks() == {asyncio.current_task()}, asyncio.all_tasks()
        return status

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        status = asyncio.run(scenario())
        gc.collect()
    assert status == (429 if isinstance(refusal(), SlotLimitError) else 400)
    logged = "\n".join(f"{r.getMessage()} {r.exc_info or ''}" for r in caplog.records)
    assert "already running" not in logged and "destroyed but it is pending" not in logged, logged
