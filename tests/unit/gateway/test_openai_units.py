"""The OpenAI-compatible edge's pure parts, without processes: chat templates, the error table,
request schemas and answer shapes. `test_openai_http.py` runs the whole thing against a real stack."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from test_openai_streams import answers, piece, summary

from loraserve import errors
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidRequestError
from loraserve.gateway.chat_template import ChatTemplate
from loraserve.gateway.events import Chunk, Logprob, Summary, TopLogprob
from loraserve.gateway.http.answering import Generation
from loraserve.gateway.http.app import OpenAiRoutes
from loraserve.gateway.http.errors import CHAT_PARAMS, HTTP_STATUS, HttpError, http_error
from loraserve.gateway.http.logprobs import LogprobFormat
from loraserve.gateway.http.responses import DONE
from loraserve.gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from loraserve.gateway.http.structured import requested_constraint
from loraserve.gateway.slots import SlotLimitError
from loraserve.structured import grammar_for
from loraserve.tokenizer import Tokenizer

# A Llama-3-style template: system prompt hoisted, loop controls, raise_exception, special tokens.
LLAMA_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% if system %}<|system|>{{ system }}{{ eos_token }}{% endif %}"
    "{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
    "{% if loop.index0 > 8 %}{% break %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": " the quiet king "},
    {"role": "assistant", "content": "finds a boat"},
    {"role": "user", "content": "and then?"},
]


def write_model(tmp_path, **config) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"} | config))


def test_the_demo_template_makes_a_conversation_the_prompt_the_completions_api_would_send():
    template = ChatTemplate.from_model_dir(DEMO_MODEL_DIR)
    tokenizer = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
    text = template.render([{"role": "system", "content": "ignored"}, {"role": "user", "content": "the quiet king"}])
    assert text == "<s>the quiet king"
    assert tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode("the quiet king")
    assert template.render(CONVERSATION) == "<s> the quiet king  finds a boat and then?"


def test_templates_render_as_transformers_renders_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_model(tmp_path, chat_template=LLAMA_LIKE)
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((DEMO_MODEL_DIR / name).read_bytes())
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = ChatTemplate.from_model_dir(tmp_path)
    for messages in (CONVERSATION, CONVERSATION[1:2], [{"role": "user", "content": str(i)} for i in range(12)]):
        assert ours.render(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    demo = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    expected = demo.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_model_dir(DEMO_MODEL_DIR).render(CONVERSATION) == expected


def test_where_templates_come_from(tmp_path):
    write_model(tmp_path)
    assert ChatTemplate.from_model_dir(tmp_path) is None  # no template: chat is refused, never guessed
    write_model(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert ChatTemplate.from_model_dir(tmp_path).render([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token }}")
    assert ChatTemplate.from_model_dir(tmp_path).render([]) == "J<s>"
    write_model(tmp_path, bos_token={"content": "<b>", "lstrip": False})
    assert ChatTemplate.from_model_dir(tmp_path).render([]) == "J<b>"
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(errors.InvalidModelError, match="does not compile"):
        ChatTemplate.from_model_dir(tmp_path)


def test_a_template_that_refuses_or_misbehaves_is_a_400_on_messages():
    with pytest.raises(InvalidRequestError, match="roles must be user or assistant") as info:
        ChatTemplate(LLAMA_LIKE).render([{"role": "tool", "content": "x"}])
    assert info.value.field == "messages"
    with pytest.raises(InvalidRequestError, match="messages"):  # the sandbox: no reaching into Python
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(InvalidRequestError, match="messages"):
        ChatTemplate("{% set x = messages.append(1) %}").render([])  # immutable: templates change nothing


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (errors.InvalidRequestError("sampling.temperature", "bad"), 400, "invalid_request_error"),
        (errors.UnauthenticatedError("no key"), 401, "authentication_error"),
        (errors.PermissionDeniedError("no scope"), 403, "permission_error"),
        (errors.AdapterNotFoundError("x"), 404, "not_found_error"),
        (errors.ResourceExhaustedError("queue full"), 429, "rate_limit_error"),
        (errors.UnavailableError("no worker"), 503, "service_unavailable_error"),
        (errors.DeadlineExceededError("late"), 504, "timeout_error"),
        (errors.error_for_status("CANCELLED", "gone"), 499, "cancelled"),
        (errors.DataLossError("bad bytes"), 500, "internal_error"),
        (RuntimeError("bug"), 500, "internal_error"),
    ],
)
def test_one_table_maps_every_failure_to_an_http_status(error, status, kind):
    failure = http_error(error)
    assert (failure.status, failure.body["error"]["type"]) == (status, kind)
    assert set(failure.body["error"]) == {"message", "type", "param", "code"}


def test_every_grpc_status_a_request_can_end_with_has_an_http_status():
    for name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND"):
        assert name in HTTP_STATUS
    for name in ("ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "DATA_LOSS"):
        assert name in HTTP_STATUS


def test_errors_name_the_openai_parameter():
    def param(field: str, params: dict[str, str] | None = None) -> tuple[str | None, str]:
        error = http_error(InvalidRequestError(field, "is wrong"), *([params] if params else [])).body["error"]
        return error["param"], error["message"]

    assert param("sampling.temperature") == ("temperature", "temperature: is wrong")
    assert param("max_new_tokens") == ("max_tokens", "max_tokens: is wrong")
    assert param("prompt.text")[0] == "prompt" and param("prompt", CHAT_PARAMS)[0] == "messages"
    assert http_error(InvalidRequestError("adapter", "bad name")).status == 404  # no such model can exist
    assert http_error(errors.AdapterNotFoundError("x")).body["error"]["code"] == "model_not_found"
    refused = http_error(SlotLimitError("over", 2.2), retry_after_s=2.2)
    assert refused.status == 429 and refused.headers == {"Retry-After": "3"}


def test_unsupported_parameters_are_named():
    def refused(kind, **fields):
        return kind(model="m", **fields).unsupported()

    prompt = {"prompt": "p"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert refused(CompletionRequest, n=2, **prompt) is None  # choices sharing the prompt's prefill
    assert refused(CompletionRequest, n=2, best_of=1, **prompt)[0] == "best_of"  # fewer candidates than choices
    assert refused(CompletionRequest, best_of=3, stream=True, **prompt)[0] == "best_of"
    assert refused(CompletionRequest, prompt=["a"] * 8, n=8) is None  # 64 generations
    assert refused(CompletionRequest, prompt=["a"] * 8, n=8, best_of=9)[0] == "best_of"
    assert refused(ChatCompletionRequest, n=64, messages=[{"role": "user", "content": "hi"}]) is None
    assert refused(CompletionRequest, n=1, **prompt) is None
    assert refused(CompletionRequest, prompt=["a", "b"]) is None  # a batch of prompts
    assert refused(CompletionRequest, prompt=["a"] * 65)[0] == "prompt"  # over MAX_PROMPTS
    assert refused(CompletionRequest, prompt=[[1, 2], [3]]) is None
    assert refused(CompletionRequest, top_p=0, **prompt)[0] == "top_p"
    assert refused(CompletionRequest, min_tokens=2, **prompt)[0] == "min_tokens"
    assert (
        refused(CompletionRequest, min_p=0.1, include_stop_str_in_output=True, skip_special_tokens=False, **prompt)
        is None
    )
    assert refused(CompletionRequest, top_k=-1, **prompt) is None
    assert refused(CompletionRequest, echo=True, logprobs=3, **prompt) is None
    assert refused(CompletionRequest, best_of=3, **prompt) is None
    assert refused(CompletionRequest, stream_options={"include_usage": True}, **prompt)[0] == "stream_options"
    assert refused(ChatCompletionRequest, tools=[{"type": "function", "function": {"name": "f"}}], **chat) is None
    assert refused(ChatCompletionRequest, logprobs=True, top_logprobs=2, **chat) is None
    assert refused(ChatCompletionRequest, top_logprobs=2, **chat)[0] == "top_logprobs"  # needs logprobs: true
    assert refused(ChatCompletionRequest, response_format={"type": "json_object"}, **chat) is None
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert refused(ChatCompletionRequest, messages=image)[0] == "messages[0].content"
    parts = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert parts.unsupported() is None and parts.conversation() == [{"role": "user", "content": "a"}]
    # what loraserve does not do is refused by name, unless the value asks for nothing
    usage_stats = {"include_usage": True, "continuous_usage_stats": True}  # what guidellm sends
    stream = {"stream": True, **prompt}
    assert refused(CompletionRequest, stream_options=usage_stats, **stream) is None
    assert CompletionRequest(model="m", stream_options=usage_stats, **stream).continuous_usage
    assert not CompletionRequest(model="m", stream_options={"continuous_usage_stats": None}, **stream).continuous_usage
    with pytest.raises(ValidationError, match="stream_options"):  # a field vLLM does not accept either
        CompletionRequest(model="m", stream_options={"include_usage": True, "per_token": True}, **stream)
    for fields in (
        {"min_tokens": 0, "use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "prompt_logprobs": None},
        {"add_special_tokens": True, "priority": 0, "store": False, "logits_processors": []},
    ):
        assert refused(CompletionRequest, **fields, **prompt) is None, fields
    assert refused(ChatCompletionRequest, echo=False, add_generation_prompt=True, modalities=["text"], **chat) is None
    assert refused(CompletionRequest, logit_bias={}, suffix="", **prompt) is None  # OpenAI's: asking for nothing
    assert refused(CompletionRequest, logit_bias={"5": 1.0}, **prompt)[0] == "logit_bias"
    assert refused(CompletionRequest, suffix="end", **prompt)[0] == "suffix"
    assert refused(CompletionRequest, max_tokens=0, **prompt)[0] == "max_tokens"  # 0: only to score the prompt
    scoring = CompletionRequest(model="m", max_tokens=0, echo=True, logprobs=1, **prompt)
    assert scoring.unsupported() is None and scoring.prompt_only and scoring.new_tokens == 1
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", max_tokens=0, **chat)
    for kind, fields, name in (
        (CompletionRequest, {"use_beam_search": True}, "use_beam_search"),
        (CompletionRequest, {"min_tokens": False}, "min_tokens"),  # false is not the count 0
        (CompletionRequest, {"add_special_tokens": False}, "add_special_tokens"),
        (CompletionRequest, {"priority": 5}, "priority"),
        (CompletionRequest, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (ChatCompletionRequest, {"echo": True}, "echo"),
        (ChatCompletionRequest, {"functions": [{"name": "f"}]}, "functions"),
        (ChatCompletionRequest, {"function_call": "auto"}, "function_call"),
        (ChatCompletionRequest, {"modalities": ["text", "audio"]}, "modalities"),
        (ChatCompletionRequest, {"add_generation_prompt": False}, "add_generation_prompt"),
        (ChatCompletionRequest, {"continue_final_message": True}, "continue_final_message"),
        (ChatCompletionRequest, {"chat_template": "{{ x }}"}, "chat_template"),
        (ChatCompletionRequest, {"add_special_tokens": True}, "add_special_tokens"),
    ):
        found = refused(kind, **fields, **(prompt if kind is CompletionRequest else chat))
        assert (found and found[0]) == name, (fields, found)


def test_sampling_defaults_are_openais():
    request = CompletionRequest(model="m", prompt="p")
    assert request.sampling()["temperature"] == 1.0 and request.sampling()["top_p"] == 1.0
    assert "seed" not in request.sampling() and request.new_tokens == 0  # 0: the gateway's default
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user"}], max_completion_tokens=5, max_tokens=9)
    assert chat.new_tokens == 5 and CompletionRequest(model="m", prompt="p", stop="x").stops == ["x"]


def test_answers_have_openais_shape():
    final = summary("length", prompt_tokens=4, completion_tokens=2)
    whole = answers(chat=True).whole([(piece("AB"), final)])
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "AB",
    }
    assert whole["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    text = answers(stream={"include_usage": True})
    assert text.opening(piece("A")) is None and text.piece(piece("A"))["usage"] is None
    assert text.closing(final)["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert text.usage([final])["choices"] == [] and text.usage([final])["object"] == "text_completion"


def test_continuous_usage_puts_each_choices_usage_so_far_in_every_chunk():
    """vLLM's continuous_usage_stats: the role chunk counts the prompt alone, each piece the tokens up to
    it, the finish chunk (and a tool answer's settled chunks) all of them; include_usage's last chunk
    still sums the choices."""
    final = summary("length", prompt_tokens=4, completion_tokens=3, cached_tokens=2)
    first = Chunk("A", [7], prompt_tokens=4, cached_tokens=2)

    def counts(chunk):
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        return usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    chat = answers(chat=True, stream={"continuous_usage_stats": True})
    assert counts(chat.opening(first)) == (4, 0, 2) and counts(chat.opening(final)) == (4, 0, 2)
    assert counts(chat.piece(first, generated=1)) == (4, 1, 2) and counts(chat.closing(final)) == (4, 3, 2)
    text = answers(stream={"include_usage": True, "continuous_usage_stats": True})
    assert counts(text.piece(Chunk("B", [8], prompt_tokens=4), first=True, generated=2)) == (4, 2, 0)
    assert text.usage([final])["choices"] == [] and counts(text.usage([final])) == (4, 3, 2)
    scoring = answers(prompt_only=True, stream={"continuous_usage_stats": True})
    assert (
        scoring.shown(first).token_ids == () and scoring.shown(final).completion_tokens == 0
    )  # nothing generated is shown
    streamed = asyncio.run(_sent(chat, [first, Chunk("", [9]), Chunk("B", [10], prompt_tokens=4), final]))
    assert [counts(c) for c in streamed] == [(4, 0, 2), (4, 1, 2), (4, 3, 0), (4, 3, 2)]  # the silent token counts


async def _sent(asked, script: list) -> list[dict]:
    """The chunks a stream of the core's events `script` sends, as `Generation` hands them over."""
    generation = Generation(_events(script))
    first = await generation.next()
    return [json.loads(e.removeprefix(b"data: ")) async for e in asked.stream([first], [generation]) if e != DONE]


async def _events(script: list):
    for event in script:
        yield event


def test_logprob_parameters_become_sampling_fields():
    assert CompletionRequest(model="m", prompt="p").sampling().keys().isdisjoint({"logprobs", "prompt_logprobs"})
    assert CompletionRequest(model="m", prompt="p", logprobs=0).sampling()["logprobs"] == 0
    echoed = CompletionRequest(model="m", prompt="p", logprobs=3, echo=True).sampling()
    assert echoed["logprobs"] == 3 and echoed["prompt_logprobs"] == 3
    assert "prompt_logprobs" not in CompletionRequest(model="m", prompt="p", echo=True).sampling()  # text only
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(model="m", logprobs=True, **chat).sampling()["logprobs"] == 0
    assert ChatCompletionRequest(model="m", logprobs=True, top_logprobs=20, **chat).sampling()["logprobs"] == 20
    assert "logprobs" not in ChatCompletionRequest(model="m", logprobs=False, **chat).sampling()
    for kind, fields in [
        (CompletionRequest, {"prompt": "p", "logprobs": 21}),
        (ChatCompletionRequest, {**chat, "top_logprobs": -1}),
    ]:
        with pytest.raises(ValidationError):
            kind(model="m", **fields)


def _entry(token_id: int, logprob: float | None, top: list[tuple[int, float]] = ()) -> Logprob:
    return Logprob(token_id, logprob, tuple(TopLogprob(t, v) for t, v in top))


def _tokenizer(texts: dict[int, str], special: frozenset[int] = frozenset()) -> SimpleNamespace:
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(texts[i] for i in ids if not (skip_special_tokens and i in special))

    return SimpleNamespace(decode=decode)


def test_logprobs_have_openais_shapes():
    texts = {1: "<s>", 2: "ab", 3: " c", 4: "\u00e9"}
    tokenizer = _tokenizer(texts, frozenset({1}))
    completion = LogprobFormat(tokenizer, chat=False)
    prompt = completion.format([_entry(1, None), _entry(2, -1.5, [(2, -1.5), (3, -2.0)])], index=1)
    assert prompt == {
        "tokens": ["<s>", "ab"],
        "token_logprobs": [None, -1.5],
        "top_logprobs": [None, {"ab": -1.5, " c": -2.0}],
        "text_offset": [0, 0],  # BOS is not in the text: "ab" begins it
    }
    later = completion.format([_entry(3, -0.25, [(3, -0.25), (2, -3.0)])], index=1)
    assert later["text_offset"] == [2] and later["top_logprobs"] == [{" c": -0.25, "ab": -3.0}]
    assert completion.format([_entry(3, -0.25)], index=0)["text_offset"] == [0]  # each choice its own offsets
    # OpenAI: "the API will always return the logprob of the sampled token" (up to k + 1 entries)
    sampled = completion.format([_entry(3, -2.5, [(2, -0.5)]), _entry(2, -0.5)], index=2)["top_logprobs"]
    assert sampled == [{"ab": -0.5, " c": -2.5}, {"ab": -0.5}]  # logprobs: 1, then logprobs: 0
    kept = LogprobFormat(tokenizer, chat=False, keep_special=True)  # skip_special_tokens: false: "<s>" is text
    assert kept.format([_entry(1, None), _entry(2, -1.0)])["text_offset"] == [0, 3]
    chat = LogprobFormat(tokenizer, chat=True).format([_entry(4, -0.5, [(4, -0.5)])])
    assert LogprobFormat(tokenizer, chat=True).format([_entry(3, -1.0, [(2, -0.5)])])["content"][0]["top_logprobs"] == [
        {"token": "ab", "logprob": -0.5, "bytes": [97, 98]}  # chat: exactly the k most likely
    ]
    assert chat == {
        "content": [
            {
                "token": "\u00e9",
                "logprob": -0.5,
                "bytes": [0xC3, 0xA9],
                "top_logprobs": [{"token": "\u00e9", "logprob": -0.5, "bytes": [0xC3, 0xA9]}],
            }
        ],
        "refusal": None,
    }


def test_echo_begins_the_text_and_the_logprobs_with_the_prompts():
    tokenizer = _tokenizer({i: f"<{i}>" for i in range(10)})
    final = summary("length", prompt_tokens=2, completion_tokens=1)
    echoed = answers(logprobs=LogprobFormat(tokenizer, chat=False), echo=["P0", "P1"])
    text = piece("x", [_entry(9, -1.0)], [_entry(5, None), _entry(6, -2.0)])
    whole = echoed.whole([(text, final), (text, final)])
    assert [c["text"] for c in whole["choices"]] == ["P0x", "P1x"]
    assert whole["choices"][1]["logprobs"]["tokens"] == ["<5>", "<6>", "<9>"]
    assert whole["choices"][1]["logprobs"]["token_logprobs"] == [None, -2.0, -1.0]
    streamed = answers(logprobs=LogprobFormat(tokenizer, chat=False), echo=["P0"])
    first = streamed.piece(text, 0, first=True)["choices"][0]
    assert first["text"] == "P0x" and first["logprobs"]["tokens"] == ["<5>", "<6>", "<9>"]
    then = streamed.piece(piece("y", [_entry(7, -0.5)]), 0)["choices"][0]
    assert then["text"] == "y" and then["logprobs"]["tokens"] == ["<7>"] and then["logprobs"]["text_offset"] == [9]


def test_chat_on_a_model_without_a_template_is_a_clear_400():
    service = SimpleNamespace(config=SimpleNamespace(model_name="plain"), limits=SimpleNamespace(max_prompt_bytes=1024))
    routes = OpenAiRoutes(service, None, 0)
    body = ChatCompletionRequest(model="plain", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(HttpError) as info:
        asyncio.run(routes.chat_completions(body, request=None, principal=None))
    assert info.value.status == 400 and info.value.body["error"]["param"] == "messages"
    assert "no chat template" in info.value.body["error"]["message"]


def test_a_stream_cancelled_while_sending_still_cancels_its_generation():
    """A client that disconnects while the stream's task waits in `send` (a slow socket) must stop
    the generation at once, not when the suspended events generator is garbage-collected."""
    import asyncio

    from loraserve.gateway.http.answering import GenerationStream

    class Recorder:
        cancelled = False

        async def close(self) -> None:
            self.cancelled = True

    async def events():
        while True:
            yield b"data: x\n\n"

    async def scenario() -> tuple[bool, bool]:
        generations, closed = [Recorder(), Recorder()], asyncio.Event()  # a batch's generations, all cancelled
        sent = 0

        async def send(message) -> None:
            nonlocal sent
            sent += 1
            if sent >= 3:
                await asyncio.Event().wait()  # the socket stopped draining

        async def receive():
            await asyncio.sleep(0.05)
            closed.set()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/", "headers": []}
        await asyncio.wait_for(GenerationStream(generations, events())(scope, receive, send), 5)
        return closed.is_set(), all(g.cancelled for g in generations)

    disconnected, cancelled = asyncio.run(scenario())
    assert disconnected and cancelled


def test_each_spelling_of_structured_output_is_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spellings = {
        "response_format": (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "json_schema",
            schema,
        ),
        "json_object": ({"response_format": {"type": "json_object"}}, "json_object", True),
        "guided_json": ({"guided_json": json.dumps(schema)}, "json_schema", json.dumps(schema)),
        "guided_regex": ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        "guided_choice": ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        "guided_grammar": ({"guided_grammar": 'start: "x"'}, "grammar", 'start: "x"'),
        "structured_outputs": ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        "structured_outputs.json_object": ({"structured_outputs": {"json_object": True}}, "json_object", True),
    }
    for name, (fields, kind, value) in spellings.items():
        body = CompletionRequest(model="m", prompt="p", **fields)
        found = requested_constraint(body.constraint_fields())
        assert found is not None and (found.kind, found.value) == (kind, value), name
        assert grammar_for(found.kind, found.value, found.field)  # each compiles to an llguidance grammar
    for nothing in ({"response_format": {"type": "text"}}, {"structured_outputs": {"json_object": False}}):
        assert requested_constraint(CompletionRequest(model="m", prompt="p", **nothing).constraint_fields()) is None
    for fields, param in (
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),  # two constraints
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),  # no schema
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            requested_constraint(CompletionRequest(model="m", prompt="p", **fields).constraint_fields())
        assert e.value.field == param, fields
    with pytest.raises(InvalidRequestError) as e:
        grammar_for("regex", "[a-", "guided_regex")
    assert e.value.field == "guided_regex" and "unclosed character class" in str(e.value)


def _tools(*names: str):
    from loraserve.gateway.http.schemas import Tool

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    return [Tool(type="function", function={"name": n, "parameters": schema}) for n in names]


def test_tool_choice_modes_and_their_answers():
    from loraserve.gateway.http.schemas import NamedToolChoice
    from loraserve.gateway.http.tool_calling import MAX_TOOL_CALLS, tool_choice
    from loraserve.gateway.tool_parsers import ParsedOutput, ToolCall, parser_named

    hermes = parser_named("hermes")
    assert tool_choice(None, None, None, hermes) is None  # no tools: text
    assert tool_choice(_tools("f"), "none", None, hermes) is None
    with pytest.raises(InvalidRequestError, match="--tool-call-parser"):
        tool_choice(_tools("f"), "auto", None, None)
    with pytest.raises(InvalidRequestError, match="needs tools"):
        tool_choice(None, "required", None, hermes)
    with pytest.raises(InvalidRequestError, match="same name"):
        tool_choice(_tools("f", "f"), "required", None, hermes)
    named = NamedToolChoice(type="function", function={"name": "g"})
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        tool_choice(_tools("f"), named, None, hermes)

    auto = tool_choice(_tools("f", "g"), None, None, hermes)  # auto is the default with tools
    assert auto.mode == "auto" and auto.constraint() is None
    text = "sure. " + hermes.format_call(ToolCall("f", '{"x": 1}')) + hermes.format_call(ToolCall("g", '{"x": 2}'))
    answered = answers(chat=True, tools=auto)
    choice = answered.whole([(piece(text), summary("stop", 3, 9))])["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "sure."
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]
    ] == [
        ("f", {"x": 1}),
        ("g", {"x": 2}),
    ]
    single = tool_choice(_tools("f", "g"), "auto", False, hermes)  # parallel_tool_calls: false keeps the first
    assert len(single.parse(text).tool_calls) == 1
    strict = _tools("f", "g")
    strict[1].function.strict = True  # one strict tool: auto is held to the parser's grammar
    held = tool_choice(strict, "auto", None, hermes).constraint()
    assert (held.kind, held.field) == ("grammar", "tools")
    assert held.value == hermes.strict_grammar(auto.functions, MAX_TOOL_CALLS)
    assert grammar_for(held.kind, held.value, held.field)  # llguidance takes it
    plain = answered.whole([(piece("just text"), summary("stop", 3, 2))])["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": "just text"}

    required = tool_choice(_tools("f", "g"), "required", False, hermes)
    asked = required.constraint()
    assert (asked.kind, asked.field, asked.value["minItems"], asked.value["maxItems"]) == (
        "json_schema",
        "tool_choice",
        1,
        1,
    )
    parsed = required.parse('[{"name":"g","parameters":{"x":5}}]')
    assert parsed.tool_calls == [ToolCall("g", '{"x": 5}')] and required.finish_reason(parsed, "stop") == "tool_calls"
    cut = required.parse('[{"name":"g","param', cut=True)  # cut by max_tokens: still a call, never content
    assert cut == ParsedOutput(None, [ToolCall("g", "")]) and required.finish_reason(cut, "length") == "length"
    several = tool_choice(_tools("f", "g"), "required", None, hermes)
    assert several.constraint().value["maxItems"] == MAX_TOOL_CALLS  # a grammar never allows an endless list
    cut = several.parse('[{"name":"f","parameters":{"x":1}},{"name":"g","parameters":{"x":', cut=True)
    assert cut.tool_calls == [ToolCall("f", '{"x": 1}'), ToolCall("g", '{"x":')]
    assert tool_choice(_tools("f"), "required", True, hermes, max_calls=2).constraint().value["maxItems"] == 2
    with pytest.raises(InvalidRequestError, match="max_tool_calls"):
        tool_choice(_tools("f"), "required", None, hermes, max_calls=MAX_TOOL_CALLS + 1)

    function = tool_choice(_tools("f", "g"), NamedToolChoice(type="function", function={"name": "f"}), None, None)
    assert function.constraint().value["required"] == ["x"]
    parsed = function.parse('{"x":3}')
    assert parsed.tool_calls == [ToolCall("f", '{"x": 3}')] and function.finish_reason(parsed, "stop") == "stop"
    length = answers(chat=True, tools=function).whole([(piece('{"x":3'), summary("length", 3, 4))])
    message = length["choices"][0]["message"]  # cut: the call with its arguments as generated, finish length
    assert message["content"] is None and message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x":3'}
    assert length["choices"][0]["finish_reason"] == "length"
    chunks = answers(chat=True, tools=function).settled(piece('{"x":3}'), summary("stop", 3, 4))
    call = chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    assert (call["index"], call["function"]) == (0, {"name": "f", "arguments": '{"x": 3}'})
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"


def test_past_tool_calls_reach_the_template_with_object_arguments():
    body = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "2"},
        ],
    )
    turns = body.conversation()
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and turns[1]["content"] == ""
    assert turns[2] == {"role": "tool", "content": "2", "tool_call_id": "c"}
    template = ChatTemplate("{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[-1].content }}")
    assert template.render(turns, [{"type": "function", "function": {"name": "f"}}]) == "f;2"


def test_best_of_keeps_each_prompts_likeliest_and_usage_counts_each_prompt_once():
    from loraserve.gateway.http.responses import best_of, summed_usage

    def result(text: str, *logprobs: float) -> tuple[Chunk, Summary]:
        entries = [Logprob(1, v) for v in logprobs]
        return piece(text, entries), summary("stop", 10, len(logprobs))

    # two prompts, three candidates each
    results = [
        result("a", -1, -1),
        result("b", -0.5),
        result("c", -3),
        result("d", -2),
        result("e", -0.1, -0.1),
        result("f", -9),
    ]
    assert [p.text for p, _ in best_of(results, 3, 2)] == ["b", "a", "e", "d"]
    assert best_of(results, 3, 3) == results
    usage = summed_usage([f for _, f in results], 3)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (20, 8)


# Every field a request body accepts takes effect (or is refused at other values). Most reach the
# GenerateRequest the body becomes: checked here by building it with and without the field. The
# others shape the answer at the HTTP edge; each names the stack test (test_openai_http.py) showing it.
REACHES_THE_REQUEST = {  # field -> (a value that asks for something, fields set beside it in both requests)
    "model": ("upper", {}),
    "max_tokens": (7, {}),
    "temperature": (0.5, {}),
    "top_p": (0.5, {}),
    "seed": (3, {}),
    "stop": (["x"], {}),
    "presence_penalty": (0.5, {}),
    "frequency_penalty": (0.5, {}),
    "top_k": (5, {}),
    "repetition_penalty": (1.5, {}),
    "ignore_eos": (True, {}),
    "stop_token_ids": ([2], {}),
    "min_p": (0.1, {}),
    "include_stop_str_in_output": (True, {}),
    "skip_special_tokens": (False, {}),
    "response_format": ({"type": "json_object"}, {}),
    "guided_json": ({"type": "integer"}, {}),
    "guided_regex": ("a+", {}),
    "guided_choice": (["a", "b"], {}),
    "guided_grammar": ('start: "a"', {}),
    "structured_outputs": ({"regex": "b+"}, {}),
    "cache_salt": ("u1", {}),
    "logprobs": (2, {}),  # chat: True (below)
    "top_logprobs": (3, {"logprobs": True}),
    "max_completion_tokens": (9, {}),
}
SHAPES_THE_ANSWER = {
    "prompt": "test_a_batch_of_prompts_answers_each_in_order",
    "messages": "test_greedy_output_is_the_grpc_apis_for_completions_and_chat",
    "stream": "test_streams_with_the_client_add_up_to_the_whole_answer",
    "stream_options": "test_raw_sse_framing",
    "n": "test_n_choices_share_their_prompts_prefill_and_best_of_answers_the_likeliest",
    "best_of": "test_n_choices_share_their_prompts_prefill_and_best_of_answers_the_likeliest",
    "echo": "test_logprobs_and_echo_are_peft_s_through_grpc_and_http",
    "user": "test_http_requests_are_traced_like_grpc_ones_and_join_the_callers_trace",
    "tools": "test_tool_choice_named_and_required_answer_valid_calls",
    "tool_choice": "test_tool_choice_named_and_required_answer_valid_calls",
    "parallel_tool_calls": "test_tool_choice_named_and_required_answer_valid_calls",
    "logit_bias": "accepted only empty: test_unsupported_parameters_are_named",
    "suffix": "accepted only empty: test_unsupported_parameters_are_named",
    "guided_decoding_backend": "only llguidance: test_each_spelling_of_structured_output_is_one_constraint",
}


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_every_accepted_field_reaches_the_request_or_shapes_the_answer(kind):
    from pathlib import Path

    base = {"model": "m", "prompt": "p"} if kind is CompletionRequest else {"model": "m", "messages": [{"role": "u"}]}
    routes = OpenAiRoutes(SimpleNamespace(config=SimpleNamespace(model_name="m")), None, 0)
    unclassified = set(kind.model_fields) - set(REACHES_THE_REQUEST) - set(SHAPES_THE_ANSWER)
    assert not unclassified, f"say where {sorted(unclassified)} take effect (and test it), or refuse them"
    tests = Path(__file__).read_text() + (Path(__file__).parents[2] / "stack" / "test_openai_http.py").read_text()
    for test in SHAPES_THE_ANSWER.values():
        assert f"def {test.rsplit(': ', 1)[-1]}(" in tests, test
    for field in set(kind.model_fields) & set(REACHES_THE_REQUEST):
        value, beside = REACHES_THE_REQUEST[field]
        if field == "logprobs" and kind is ChatCompletionRequest:
            value = True
        plain = routes._draft(kind(**base | beside))
        asked = routes._draft(kind(**base | beside | {field: value}))
        assert asked != plain, f"{field}: {value!r} changes nothing in the request"


def test_the_readme_lists_every_refusal():
    """The README's one table of refusals names every field the schemas refuse by name."""
    from pathlib import Path

    from loraserve.gateway.http.schemas import CHAT_NOT_IMPLEMENTED, COMPLETION_NOT_IMPLEMENTED, NOT_IMPLEMENTED

    readme = (Path(__file__).parents[3] / "README.md").read_text()
    table = readme[readme.index("| refused | why |") :]
    table = table[: table.index("\n\n")]
    named = set(re.findall(r"`([a-z_.]+)", table))
    refused = {*NOT_IMPLEMENTED, *CHAT_NOT_IMPLEMENTED, *COMPLETION_NOT_IMPLEMENTED}
    others = {"top_p", "repetition_penalty", "best_of", "top_logprobs", "stream_options"}
    others |= {"logit_bias", "suffix", "guided_decoding_backend", "response_format", "structured_outputs"}
    others |= {"tool_choice", "ignore_eos", "lora_int_id"}
    assert not (refused | others) - named, sorted((refused | others) - named)
