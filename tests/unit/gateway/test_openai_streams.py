"""A stream says what the whole answer says: the SSE chunks of `Answers.stream`, choice by choice,
add up to the text, log-probabilities and finish reason of `Answers.whole` for the same generations.

The generations are scripted (no processes): each is a list of the core's events, chunks then a
`Summary`, as `generation.Generation` hands them over. The cases are the ones where the two paths part: a choice
that ends before any text (a stop sequence at once: its echo must still come), several choices of
one chat (each its own role chunk), a batch of prompts with echo and log-probabilities.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from loraserve.gateway.events import Chunk, Event, Logprob, Summary, TopLogprob
from loraserve.gateway.http.logprobs import LogprobFormat
from loraserve.gateway.http.responses import Answers, sse
from loraserve.gateway.http.schemas import ChatCompletionRequest, CompletionRequest

TEXTS = {i: f"<{i}>" for i in range(20)}
TOKENIZER = SimpleNamespace(  # token 1 is special (BOS): left out of texts unless kept
    decode=lambda ids, skip_special_tokens=True: "".join(TEXTS[i] for i in ids if not (skip_special_tokens and i == 1))
)


def _entry(token_id: int, logprob: float | None = -1.0) -> Logprob:
    return Logprob(token_id, logprob, (TopLogprob(2, -0.5),))


def piece(text: str, logprobs: list[Logprob] = (), prompt_logprobs: list[Logprob] = ()) -> Chunk:
    """A chunk of `text`, its tokens those of its log-probabilities (3 prompt tokens)."""
    return Chunk(text, [e.token_id for e in logprobs], logprobs, prompt_logprobs, 3)


def summary(reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Summary:
    return Summary("r", "c", reason, prompt_tokens, completion_tokens, cached_tokens)


def answers(chat: bool = False, n: int = 1, prompt_only: bool = False, stream: dict | None = None, **fields) -> Answers:
    """The answers of a chat or completions body (`n` choices, `max_tokens: 0` for `prompt_only`, the
    `stream_options` `stream`) with `fields`."""
    asked = {"model": "m", "n": n, "stream_options": stream}
    if chat:
        return Answers("id", ChatCompletionRequest(messages=[{"role": "user"}], **asked), **fields)
    return Answers("id", CompletionRequest(prompt="p", max_tokens=0 if prompt_only else None, **asked), **fields)


class Scripted:
    """A generation whose events are given: `next()` hands them over one by one."""

    def __init__(self, events: list[Event]):
        self.events = list(events)

    async def next(self) -> Event:
        await asyncio.sleep(0)  # let the others interleave
        return self.events.pop(0)


def _streamed(answers: Answers, scripts: list[list[Event]]) -> list[dict]:
    async def run() -> list[bytes]:
        generations = [Scripted(s) for s in scripts]
        firsts = [await g.next() for g in generations]
        return [event async for event in answers.stream(firsts, generations)]

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


def _whole(answers: Answers, scripts: list[list[Event]]) -> dict[int, dict]:
    results = [(Chunk.joined(s[:-1]) if len(s) > 1 else Chunk(""), s[-1]) for s in scripts]
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


STOPPED = summary("stop", 3, 1)
LENGTH = summary("length", 3, 2)
CASES = {
    # a stop sequence right away: no piece at all, yet the answer begins with the prompt
    "echo, no text": (dict(chat=False, echo=["P0"]), [[STOPPED]]),
    "echo, logprobs, batch": (
        dict(chat=False, echo=["P0", "P1"], logprobs=True),
        [
            [piece("a", [_entry(5)], [_entry(1, None), _entry(3)]), piece("b", [_entry(6)]), LENGTH],
            [piece("", [_entry(7)], [_entry(1, None), _entry(4)]), STOPPED],
        ],
    ),
    "echo, n=2, one empty": (
        dict(chat=False, echo=["P0", "P0"], n=2),
        [[piece("x"), LENGTH], [STOPPED]],
    ),
    "max_tokens 0 with echo: the prompt scored alone": (
        dict(chat=False, echo=["P0", "P1"], logprobs=True, prompt_only=True),
        [
            [piece("a", [_entry(5)], [_entry(1, None), _entry(3)]), LENGTH],
            [piece("", [_entry(7)], [_entry(1, None), _entry(4)]), STOPPED],
        ],
    ),
    "max_tokens 0 with echo, no log-probabilities": (
        dict(chat=False, echo=["P0"], prompt_only=True),
        [[piece("a"), LENGTH]],
    ),
    "chat, n=3": (
        dict(chat=True, logprobs=True, n=3),
        [[piece("a", [_entry(5)]), LENGTH], [STOPPED], [piece("b", [_entry(6)]), piece("c", [_entry(7)]), LENGTH]],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_stream_adds_up_to_the_whole_answer(case):
    fields, scripts = CASES[case]
    fields = fields | {"logprobs": LogprobFormat(TOKENIZER, fields["chat"]) if fields.get("logprobs") else None}
    streamed = _joined(_streamed(answers(**fields), scripts), fields["chat"])
    fields["logprobs"] = fields["logprobs"] and LogprobFormat(TOKENIZER, fields["chat"])  # fresh text offsets
    whole = _whole(answers(**fields), scripts)
    assert {i: {k: v for k, v in s.items() if k != "roles"} for i, s in streamed.items()} == whole
    if fields["chat"]:  # each choice opens with the assistant's role, as OpenAI's streams do
        assert [streamed[i]["roles"] for i in sorted(streamed)] == [1] * len(scripts)


def test_max_tokens_0_answers_the_prompt_alone():
    fields = dict(chat=False, echo=["P0"], logprobs=LogprobFormat(TOKENIZER, False), prompt_only=True)
    script = [piece("a", [_entry(5)], [_entry(1, None), _entry(3)]), STOPPED]
    whole = answers(**fields).whole([(script[0], STOPPED)])
    (choice,) = whole["choices"]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]["tokens"]) == ("P0", "length", ["<1>", "<3>"])
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == 3


def test_streamed_text_offsets_go_on_from_chunk_to_chunk():
    asked = answers(echo=["P0"], logprobs=LogprobFormat(TOKENIZER, chat=False))
    script = [piece("<5>", [_entry(5)], [_entry(1, None), _entry(3)]), piece("<6>", [_entry(6)]), LENGTH]
    offsets = [
        o
        for c in _streamed(asked, [script])
        if c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == [0, 0, 3, 6]  # BOS (special, not in the text) takes no room


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [None, {"include_usage": True}])
def test_a_text_piece_from_its_template_is_the_chunk_encoded_whole(chat, stream):
    """`text_piece` writes a chunk's text into a template made once per choice: the bytes are exactly what
    encoding the whole chunk gives, whatever the text holds (the template's own hole included), and a
    stream of several pieces reads as the same text."""
    made = answers(chat=chat, n=2, stream=stream)
    texts = ["plain", 'a "quote" \\ and\nnewline', "é ünï 字 😀", "\x00text\x00", "", "\ud800"]
    for index in (0, 1):
        for text in texts:
            assert made.text_piece(text, index) == sse(made.piece(Chunk(text), index)), (index, text)
    streamed = _streamed(answers(chat=chat, stream=stream), [[piece("a"), piece('"b"'), piece("😀"), LENGTH]])
    assert _joined(streamed, chat)[0]["text"] == 'a"b"😀'
