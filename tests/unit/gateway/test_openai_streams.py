"""A stream says what the whole answer says: the SSE chunks of `answering._events`, choice by choice,
add up to the text, log-probabilities and finish reason of `Answers.whole` for the same generations.

The generations are scripted (no processes): each is a list of events, pieces then a `Final`, as
`generation.Generation` hands them over. The cases are the ones where the two paths part: a choice
that ends before any text (a stop sequence at once: its echo must still come), several choices of
one chat (each its own role chunk), a batch of prompts with echo and log-probabilities.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from loraserve.gateway.events import Logprob, TopLogprob
from loraserve.gateway.http.answering import _events
from loraserve.gateway.http.logprobs import LogprobFormat
from loraserve.gateway.http.responses import Answers, Final, Piece

TEXTS = {i: f"<{i}>" for i in range(20)}
TOKENIZER = SimpleNamespace(  # token 1 is special (BOS): left out of texts unless kept
    decode=lambda ids, skip_special_tokens=True: "".join(TEXTS[i] for i in ids if not (skip_special_tokens and i == 1))
)


def _entry(token_id: int, logprob: float | None = -1.0) -> Logprob:
    return Logprob(token_id, logprob, (TopLogprob(2, -0.5),))


class Scripted:
    """A generation whose events are given: `next()` hands them over one by one."""

    def __init__(self, events: list[Piece | Final]):
        self.events = list(events)

    async def next(self) -> Piece | Final:
        await asyncio.sleep(0)  # let the others interleave
        return self.events.pop(0)


def _streamed(answers: Answers, scripts: list[list[Piece | Final]]) -> list[dict]:
    async def run() -> list[bytes]:
        generations = [Scripted(s) for s in scripts]
        firsts = [await g.next() for g in generations]
        return [event async for event in _events(firsts, generations, answers)]

    events = asyncio.run(run())
    assert events[-1] == b"data: [DONE]\n\n"
    return [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]


def _joined(chunks: list[dict], chat: bool) -> dict[int, dict]:
    """Per choice index: its text, log-probability tokens, finish reason and role chunks."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            seen = out.setdefault(choice["index"], {"text": "", "tokens": [], "finish_reason": None, "roles": 0})
            if chat:
                seen["text"] += choice["delta"].get("content") or ""
                seen["roles"] += "role" in choice["delta"]
            else:
                seen["text"] += choice["text"]
            logprobs = choice["logprobs"]
            if logprobs is not None:
                seen["tokens"] += [c["token"] for c in logprobs["content"]] if chat else logprobs["tokens"]
            seen["finish_reason"] = choice["finish_reason"] or seen["finish_reason"]
    return out


def _whole(answers: Answers, scripts: list[list[Piece | Final]]) -> dict[int, dict]:
    results = [(Piece.joined([e for e in s if isinstance(e, Piece)]), s[-1]) for s in scripts]
    out = {}
    for choice in answers.whole(results)["choices"]:
        text = choice["message"]["content"] if answers.chat else choice["text"]
        logprobs = choice["logprobs"]
        tokens = (
            []
            if logprobs is None
            else [c["token"] for c in logprobs["content"]]
            if answers.chat
            else logprobs["tokens"]
        )
        out[choice["index"]] = {"text": text or "", "tokens": tokens, "finish_reason": choice["finish_reason"]}
    return out


STOPPED = Final("stop", 3, 1)
LENGTH = Final("length", 3, 2)
CASES = {
    # a stop sequence right away: no piece at all, yet the answer begins with the prompt
    "echo, no text": (dict(chat=False, echo=["P0"]), [[STOPPED]]),
    "echo, logprobs, batch": (
        dict(chat=False, echo=["P0", "P1"], logprobs=True),
        [
            [Piece("a", [_entry(5)], [_entry(1, None), _entry(3)]), Piece("b", [_entry(6)]), LENGTH],
            [Piece("", [_entry(7)], [_entry(1, None), _entry(4)]), STOPPED],
        ],
    ),
    "echo, n=2, one empty": (
        dict(chat=False, echo=["P0", "P0"], choices_per_prompt=2),
        [[Piece("x"), LENGTH], [STOPPED]],
    ),
    "max_tokens 0 with echo: the prompt scored alone": (
        dict(chat=False, echo=["P0", "P1"], logprobs=True, prompt_only=True),
        [
            [Piece("a", [_entry(5)], [_entry(1, None), _entry(3)]), LENGTH],
            [Piece("", [_entry(7)], [_entry(1, None), _entry(4)]), STOPPED],
        ],
    ),
    "max_tokens 0 with echo, no log-probabilities": (
        dict(chat=False, echo=["P0"], prompt_only=True),
        [[Piece("a"), LENGTH]],
    ),
    "chat, n=3": (
        dict(chat=True, logprobs=True, choices_per_prompt=3),
        [[Piece("a", [_entry(5)]), LENGTH], [STOPPED], [Piece("b", [_entry(6)]), Piece("c", [_entry(7)]), LENGTH]],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_stream_adds_up_to_the_whole_answer(case):
    fields, scripts = CASES[case]
    fields = fields | {"logprobs": LogprobFormat(TOKENIZER, fields["chat"]) if fields.get("logprobs") else None}
    streamed = _joined(_streamed(Answers("id", "m", **fields), scripts), fields["chat"])
    fields["logprobs"] = fields["logprobs"] and LogprobFormat(TOKENIZER, fields["chat"])  # fresh text offsets
    whole = _whole(Answers("id", "m", **fields), scripts)
    assert {i: {k: v for k, v in s.items() if k != "roles"} for i, s in streamed.items()} == whole
    if fields["chat"]:  # each choice opens with the assistant's role, as OpenAI's streams do
        assert [streamed[i]["roles"] for i in sorted(streamed)] == [1] * len(scripts)


def test_max_tokens_0_answers_the_prompt_alone():
    fields = dict(chat=False, echo=["P0"], logprobs=LogprobFormat(TOKENIZER, False), prompt_only=True)
    script = [Piece("a", [_entry(5)], [_entry(1, None), _entry(3)]), STOPPED]
    whole = Answers("id", "m", **fields).whole([(Piece.joined(script[:1]), STOPPED)])
    (choice,) = whole["choices"]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]["tokens"]) == ("P0", "length", ["<1>", "<3>"])
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == 3


def test_streamed_text_offsets_go_on_from_chunk_to_chunk():
    answers = Answers("id", "m", chat=False, echo=["P0"], logprobs=LogprobFormat(TOKENIZER, chat=False))
    script = [Piece("<5>", [_entry(5)], [_entry(1, None), _entry(3)]), Piece("<6>", [_entry(6)]), LENGTH]
    offsets = [
        o
        for c in _streamed(answers, [script])
        if c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == [0, 0, 3, 6]  # BOS (special, not in the text) takes no room
