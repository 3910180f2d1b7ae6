"""Tool call parsers: model text in the hermes and llama3_json formats into OpenAI tool calls."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.gateway.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    ParsedOutput,
    ToolCall,
    call_id,
    parser_named,
)

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
TIME = ToolCall("get_time", json.dumps({"tz": "Europe/Paris"}))


def hermes(*calls: ToolCall) -> str:
    return "\n".join(HermesParser().format_call(c) for c in calls)


# hermes


def test_hermes_one_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    assert HermesParser().parse(text) == ParsedOutput(content=None, tool_calls=[WEATHER])


def test_hermes_several_calls_and_tight_whitespace() -> None:
    text = hermes(WEATHER) + '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}</tool_call>'
    assert HermesParser().parse(text).tool_calls == [WEATHER, TIME]


def test_hermes_content_before_call() -> None:
    parsed = HermesParser().parse("  Let me check the weather.\n\n" + hermes(WEATHER))
    assert parsed == ParsedOutput(content="Let me check the weather.", tool_calls=[WEATHER])


def test_hermes_unicode_and_nested_arguments() -> None:
    args = {"text": "héllo 世界 🌍", "filter": {"tags": ["a", {"deep": [1, None, True]}], "limit": 3}}
    text = f"<tool_call>{json.dumps({'name': 'search', 'arguments': args})}</tool_call>"  # ASCII-escaped input
    [call] = HermesParser().parse(text).tool_calls
    assert call == ToolCall("search", json.dumps(args, ensure_ascii=False))
    assert "世界" in call.arguments


def test_hermes_missing_and_string_arguments() -> None:
    parser = HermesParser()
    assert parser.parse('<tool_call>{"name": "ping"}</tool_call>').tool_calls == [ToolCall("ping", "{}")]
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"Europe/Paris\\"}"}</tool_call>'
    assert parser.parse(text).tool_calls == [TIME]


def test_hermes_unclosed_final_call_at_end() -> None:
    text = hermes(WEATHER) + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
    assert HermesParser().parse(text).tool_calls == [WEATHER, TIME]
    cut = hermes(WEATHER) + '\n<tool_call>\n{"name": "get_time", "argu'
    assert HermesParser().parse(cut) == ParsedOutput(content=cut, tool_calls=[])  # not cut by max_tokens: text
    assert HermesParser().parse(cut, cut=True) == ParsedOutput(None, [WEATHER, ToolCall("get_time", "")])


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "Eur', [ToolCall("get_time", '{"tz": "Eur')]),
        ('<tool_call>\n{"name": "get_time", "arguments": ', [ToolCall("get_time", "")]),
        ('<tool_call>\n{"name": "get_ti', [ToolCall("get_time", "")]),  # one tool begins so
        ('<tool_call>\n{"name": "get_', []),  # get_time or get_weather: no guess
        ('<tool_call>\n{"na', []),
        ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "x"}}\n</tool_', [ToolCall("get_time", '{"tz": "x"}')]),
    ],
)
def test_a_call_cut_by_max_tokens_is_a_call_with_its_arguments_as_generated(text, calls) -> None:
    names = ("get_time", "get_weather")
    parsed = HermesParser().parse("Checking. " + text, cut=True, names=names)
    assert parsed == ParsedOutput("Checking.", calls)  # never the call's raw text in the content
    llama = Llama3JsonParser().parse(
        LLAMA_CALL + "; " + text.removeprefix("<tool_call>\n").replace('"arguments"', '"parameters"'), True, names
    )
    if not text.endswith("</tool_"):
        assert llama == ParsedOutput(None, [ToolCall("get_time", '{"zone": 2}'), *calls])


def test_hermes_closing_tag_inside_a_string_argument() -> None:
    call = ToolCall("echo", json.dumps({"s": "</tool_call> <tool_call>"}))
    assert HermesParser().parse(hermes(call, TIME)).tool_calls == [call, TIME]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',  # invalid JSON
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # missing name
        '<tool_call>{"name": 42, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>["f", {}]</tool_call>',  # not an object
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        hermes(WEATHER) + '<tool_call>{"name": "broken", "arguments": {</tool_call>',  # one bad call spoils all
    ],
)
def test_hermes_malformed_is_plain_content(text: str) -> None:
    assert HermesParser().parse(text) == ParsedOutput(content=text, tool_calls=[])


# llama3_json


def test_llama3_one_call() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    assert Llama3JsonParser().parse(text) == ParsedOutput(content=None, tool_calls=[WEATHER])


def test_llama3_python_tag_and_arguments_key() -> None:
    text = ' <|python_tag|>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
    assert Llama3JsonParser().parse(text) == ParsedOutput(content=None, tool_calls=[TIME])


def test_llama3_semicolon_separated() -> None:
    parser = Llama3JsonParser()
    one, two = parser.format_call(WEATHER), parser.format_call(TIME)
    assert parser.parse(f"{one}; {two}").tool_calls == [WEATHER, TIME]
    assert parser.parse(f"{one};{two};\n").tool_calls == [WEATHER, TIME]


def test_llama3_unicode_and_nested_arguments() -> None:
    args = {"q": "naïve café ✓", "opts": {"langs": ["fr", "日本語"], "n": {"max": 5, "exact": False}}}
    [call] = Llama3JsonParser().parse(json.dumps({"name": "search", "parameters": args})).tool_calls
    assert call == ToolCall("search", json.dumps(args, ensure_ascii=False))


@pytest.mark.parametrize(
    "text",
    [
        'I will call {"name": "get_time", "parameters": {}}',  # does not start with {
        '{"name": "get_time", "parameters": {',  # invalid JSON
        '{"parameters": {"tz": "UTC"}}',  # missing name
        '{"name": "get_time", "parameters": {}} and then some',  # trailing junk
        '{"name": "a", "parameters": {}}; not json',
        '{"name": "a", "parameters": {}}; [1]',
        '{"name": "a", "parameters": [1]}',
    ],
)
def test_llama3_malformed_is_plain_content(text: str) -> None:
    assert Llama3JsonParser().parse(text) == ParsedOutput(content=text, tool_calls=[])


# both


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_plain_and_empty_text(name: str) -> None:
    parser = parser_named(name)
    assert parser.parse("The weather in Paris is sunny.") == ParsedOutput("The weather in Paris is sunny.", [])
    assert parser.parse("") == ParsedOutput(None, [])
    assert parser.parse(" \n ") == ParsedOutput(None, [])


def test_parser_named() -> None:
    assert isinstance(parser_named("hermes"), HermesParser)
    assert isinstance(parser_named("llama3_json"), Llama3JsonParser)
    assert parser_named("hermes").name == "hermes"
    with pytest.raises(ValueError, match="mistral") as err:
        parser_named("mistral")
    assert "hermes" in str(err.value) and "llama3_json" in str(err.value)


def test_call_id() -> None:
    ids = {call_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
OBJECTS = st.dictionaries(st.text(), JSON, max_size=6)


@settings(derandomize=True, max_examples=200)
@given(parser_name=st.sampled_from(sorted(PARSERS)), name=NAMES, args=OBJECTS)
def test_format_call_round_trips(parser_name: str, name: str, args: dict) -> None:
    parser = parser_named(parser_name)
    call = ToolCall(name, json.dumps(args, ensure_ascii=False))
    parsed = parser.parse(parser.format_call(call))
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(name, args)]
    assert parsed.tool_calls == [call]


# strict grammars: what tool_choice "auto" with strict tools is held to (checked with llguidance itself)

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "get_time": {"type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]},
}


def _allows(parser_name: str, max_calls: int, text: str) -> bool:
    """Whether the parser's strict grammar lets a model write `text` (the demo tokenizer's tokens) and stop."""
    from llguidance import LLMatcher, LLTokenizer

    from loraserve.demo.assets import DEMO_MODEL_DIR
    from loraserve.structured import grammar_for
    from loraserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
    ll = LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids))
    matcher = LLMatcher(ll, grammar_for("grammar", parser_named(parser_name).strict_grammar(SCHEMAS, max_calls), "t"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_time", "parameters": {"zone":2}}'


@pytest.mark.parametrize(
    ("parser_name", "max_calls", "text", "allowed"),
    [
        ("hermes", 16, "plain text, {braces} and all", True),
        ("hermes", 16, "", True),
        ("hermes", 16, "Let me look. " + HERMES_CALL, True),
        ("hermes", 16, HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Rome"), True),
        ("hermes", 16, HERMES_CALL.replace('"Paris"', '"Ouagadougou"'), False),  # over maxLength
        ("hermes", 16, HERMES_CALL.replace('"city"', '"town"'), False),  # not its schema
        ("hermes", 16, HERMES_CALL.replace("get_weather", "get_wether"), False),  # no such tool
        ("hermes", 1, HERMES_CALL, True),
        ("hermes", 1, HERMES_CALL + "\n" + HERMES_CALL, False),  # one call only
        ("hermes", 2, "\n".join([HERMES_CALL] * 2), True),
        ("hermes", 2, "\n".join([HERMES_CALL] * 3), False),  # the count bound
        ("llama3_json", 2, "; ".join([LLAMA_CALL] * 2), True),
        ("llama3_json", 2, "; ".join([LLAMA_CALL] * 3), False),
        ("llama3_json", 16, "no call here {", True),
        ("llama3_json", 16, LLAMA_CALL, True),
        ("llama3_json", 16, LLAMA_CALL + "; " + LLAMA_CALL, True),
        ("llama3_json", 1, LLAMA_CALL + "; " + LLAMA_CALL, False),  # one call only
        ("llama3_json", 16, LLAMA_CALL.replace("2", '"two"'), False),
        ("llama3_json", 16, '{"x": 1}', False),  # text that opens with "{" is a call
    ],
)
def test_strict_grammars_let_text_run_and_hold_calls_to_their_schemas(parser_name, max_calls, text, allowed):
    assert _allows(parser_name, max_calls, text) is allowed
    if allowed and ("<tool_call>" in text or text.startswith("{")):
        assert parser_named(parser_name).parse(text).tool_calls  # a call the grammar lets through, the parser reads
