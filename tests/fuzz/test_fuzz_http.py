"""Property-based fuzzing of the OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`,
`/tokenize`, `/detokenize`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

Hypothesis builds request bodies field by field: each OpenAI parameter absent, well formed, at an
edge (0, negative, huge, NaN as a string, empty) or any JSON value at all, strings that include lone
surrogates and control characters, plus unknown fields and raw bytes that are not JSON (or not
UTF-8). One stack on the embedded demo model (one worker, the HTTP port) serves the module; the
bodies are sent over a real socket. Properties: no answer is a 5xx or hangs, a stream never carries
an internal error and ends with `[DONE]`, an accepted generation answers one choice per prompt and
`n` (indices 0, 1, ... in order; a stream closes each exactly once), and the gateway still
generates afterwards. Every field the request schemas accept, and every one they refuse by name, is
generated (`test_the_fuzzer_covers_every_field`). `max_tokens` stays small when it is a valid
number, so that accepted requests finish quickly.

Examples are few by default (the module stays well under 30 s) and derandomized when CI is set; for
a longer hunt: LORASERVE_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -q tests/fuzz/test_fuzz_http.py
"""

from __future__ import annotations

import http.client
import json
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.gateway.http.schemas import (
    CHAT_NOT_IMPLEMENTED,
    COMPLETION_NOT_IMPLEMENTED,
    NOT_IMPLEMENTED,
    ChatCompletionRequest,
    CompletionRequest,
)

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("LORASERVE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
BASE = DEMO_MODEL_DIR.name
PROMPT = "the quiet king"
SURROGATES = ["\ud800", "\udfff", "a\udc80b", "\ud83d"]  # lone halves: JSON can spell them, UTF-8 cannot

_TEXT = st.one_of(st.text(max_size=24), st.sampled_from([PROMPT, "upper", "x", "\n"]))
_ODD_TEXT = st.one_of(
    st.text(st.characters(codec=None, categories=["Cs", "Cc", "Co", "Zs", "Lo"]), max_size=8),  # Cs: surrogates
    st.sampled_from([*SURROGATES, "", " ", "\x00", "a" * 3000, "<|endoftext|>"]),
)
_NUMBER = st.one_of(
    st.integers(-3, 8),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 2**32, 2**63, 2**64, 1e308, -0.0, 0.5, 2.5]),
)
_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), _NUMBER, _TEXT, _ODD_TEXT),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(_TEXT, _ODD_TEXT), inner, max_size=4)
    ),
    max_leaves=12,
)
_TOKEN_IDS = st.lists(st.integers(0, 300), min_size=1, max_size=12)

# values the gateway takes, mostly (a mutation below puts anything else in any parameter)
_SHARED = {
    "temperature": st.floats(0, 2),
    "top_p": st.one_of(st.floats(0.05, 1), st.just(0)),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=4)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "user": _TEXT,
    "ignore_eos": st.booleans(),
    "min_p": st.floats(0, 1),
    "stop_token_ids": st.lists(st.integers(0, 1100), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "cache_salt": _TEXT,
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "logit_bias": st.one_of(
        st.just({}), st.dictionaries(st.sampled_from(["5", "x"]), st.floats(-100, 100), max_size=2)
    ),
}


def _not_implemented(table: dict) -> st.SearchStrategy:
    """Mostly nothing, else one or two of the fields that are refused unless they ask for nothing: each
    with such a value or any other."""
    field = st.sampled_from(sorted(table)).flatmap(
        lambda name: st.tuples(st.just(name), st.one_of(st.sampled_from([None, *table[name][0]]), _JSON))
    )
    return st.one_of(st.just({}), st.just({}), st.lists(field, min_size=1, max_size=2).map(dict))


_SCHEMA = st.one_of(
    st.sampled_from(
        [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"enum": ["x", "y"]},
            {"type": "string", "maxLength": 3},
            {"type": "nonsense"},
            {"$ref": "#/nowhere"},
            {},
        ]
    ),
    _JSON,
)
_REGEX = st.one_of(st.sampled_from(["[a-z]{1,3}", "(ab|cd)", "[a-", "x*", "\\p{L}", "(?=a)"]), _TEXT)
_GRAMMAR = st.one_of(st.sampled_from(['start: "a" | "b"', 'root ::= "x" [0-9]', "start: missing", ""]), _TEXT)
_RESPONSE_FORMAT = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"}]),
    st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": True}}, _SCHEMA),
)
# structured output (each kind, valid and not); the gateway refuses two at once
_STRUCTURED = {
    "response_format": _RESPONSE_FORMAT,
    "guided_json": st.one_of(_SCHEMA, st.builds(json.dumps, _SCHEMA)),
    "guided_regex": _REGEX,
    "guided_choice": st.lists(st.one_of(_TEXT, _ODD_TEXT), max_size=3),
    "guided_grammar": _GRAMMAR,
    "guided_decoding_backend": st.sampled_from(["auto", "llguidance", "xgrammar"]),
    "structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "other"]), st.one_of(_SCHEMA, _REGEX), max_size=2
    ),
}
_FUNCTION = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["get_weather", "lookup", "bad name!"]), _TEXT)},
    optional={"description": _TEXT, "parameters": _SCHEMA, "strict": st.booleans()},
)
_TOOLS = {
    "tools": st.lists(st.builds(lambda f: {"type": "function", "function": f}, _FUNCTION), max_size=3),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required", "other"]),
        st.builds(lambda n: {"type": "function", "function": {"name": n}}, st.sampled_from(["get_weather", "x"])),
    ),
    "parallel_tool_calls": st.booleans(),
}
_OTHER = ["unknown_field"]  # fields only mutations set
_MODEL = st.sampled_from(["upper", "rot13", "title", BASE, BASE, "no-such-adapter"])


def _bodies(required: dict, optional: dict, other: list[str], refused: dict | None = None) -> st.SearchStrategy:
    """Bodies the gateway mostly takes, half of them with one or two fields (`other` ones too) set to any
    JSON value, odd strings included; a third with fields of `refused` (`_not_implemented`)."""
    fields = sorted([*required, *optional, *_OTHER, *other])
    changes = st.dictionaries(st.sampled_from(fields), st.one_of(_JSON, _ODD_TEXT), min_size=1, max_size=2)
    base = st.fixed_dictionaries(required, optional=optional)
    extensions = _not_implemented(refused) if refused else st.just({})
    return st.builds(
        lambda body, extra, changed: body | extra | changed, base, extensions, st.one_of(st.just({}), changes)
    )


_COMPLETION_REQUIRED = {
    "model": _MODEL,
    "prompt": st.one_of(
        _TEXT.filter(bool), _TOKEN_IDS, st.lists(_TEXT, min_size=1, max_size=3), st.lists(_TOKEN_IDS, max_size=3)
    ),
    "max_tokens": st.integers(0, 4),  # 0: with echo, the prompt scored alone
}
_COMPLETION_OPTIONAL = (
    _SHARED
    | _STRUCTURED
    | {
        "logprobs": st.integers(0, 20),
        "echo": st.booleans(),
        "best_of": st.integers(1, 4),
        "suffix": st.sampled_from(["", "end"]),
    }
)
COMPLETIONS = _bodies(_COMPLETION_REQUIRED, _COMPLETION_OPTIONAL, [], NOT_IMPLEMENTED | COMPLETION_NOT_IMPLEMENTED)
_CONTENT = st.one_of(_TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=3))
_TOOL_CALL = st.builds(
    lambda name, args: {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}},
    _TEXT,
    st.one_of(st.builds(json.dumps, _JSON), _TEXT),
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": _CONTENT},
    optional={"name": _TEXT, "tool_calls": st.lists(_TOOL_CALL, max_size=2), "tool_call_id": _TEXT},
)
_CHAT_REQUIRED = {
    "model": _MODEL,
    "messages": st.lists(_MESSAGE, min_size=1, max_size=3),
    "max_tokens": st.integers(1, 4),
}
_CHAT_OPTIONAL = (
    _SHARED
    | _STRUCTURED
    | _TOOLS
    | {"max_completion_tokens": st.integers(1, 4), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}
)
CHAT = _bodies(_CHAT_REQUIRED, _CHAT_OPTIONAL, [], NOT_IMPLEMENTED | CHAT_NOT_IMPLEMENTED)
TOKENIZE = _bodies(
    {},
    {
        "model": _MODEL,
        "prompt": _TEXT,
        "messages": st.lists(_MESSAGE, min_size=1, max_size=3),
        "add_special_tokens": st.booleans(),
        "return_token_strs": st.booleans(),
    },
    [],
)
DETOKENIZE = _bodies({"tokens": st.one_of(_TOKEN_IDS, st.lists(_NUMBER, max_size=4))}, {"model": _MODEL}, [])
# An open gateway lets any caller load and unload: never under a name the other tests use (a
# mutation may set lora_name to anything, so whole bodies are filtered).
_IN_USE = ("upper", "rot13", "title", BASE)
_LOAD = _bodies({"lora_name": _TEXT, "lora_path": st.one_of(_TEXT, st.sampled_from(["upper", "../x", "/etc"]))}, {}, [])
ADAPTER_ROUTES = st.one_of(
    _LOAD.map(lambda body: ("/v1/load_lora_adapter", body)),
    _bodies({"lora_name": _TEXT}, {"lora_int_id": _NUMBER}, []).map(lambda body: ("/v1/unload_lora_adapter", body)),
).filter(lambda route: route[1].get("lora_name") not in _IN_USE)
DEEP = b"[" * 50_000  # nested past Python's recursion limit
DEEP_SURROGATE = b'{"model": "upper", "prompt": "x", "deep": ' + b"[" * 900 + b'"\\ud800"' + b"]" * 900 + b"}"
RAW = st.one_of(
    st.binary(max_size=80),
    st.sampled_from(
        [
            b"",
            b"{",
            b"[]",
            b"null",
            b'{"model": "upper", "prompt": "\xff\xfe"}',
            b'{"prompt": "\\ud800"',
            b"\xef\xbb\xbf{}",
            DEEP,
            DEEP_SURROGATE,
        ]
    ),
)


@pytest.fixture(scope="module")
def stack():
    http_port = free_port_block(1)
    adapter_root = str(DEMO_MODEL_DIR.parent / "adapters")  # the demo adapters: loads can succeed
    stack = LocalStack(
        DEMO_MODEL_DIR,
        workers=1,
        http_bind=f"127.0.0.1:{http_port}",
        adapter_root=adapter_root,
        tool_call_parser="hermes",
    )
    stack.http_port = http_port
    stack.start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


def send(stack, path: str, body: bytes, content_type: str | None = "application/json") -> tuple[int, bytes]:
    """POST `body` to `path`: (status, whole answer body)."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    try:
        conn.request("POST", path, body, {"Content-Type": content_type} if content_type else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def check(stack, path: str, body: bytes, choices: int | None = None) -> None:
    """The properties of one request's answer; `choices`: how many an accepted generation answers."""
    status, answer = send(stack, path, body)
    where = f"{path} {body[:300]!r} -> {status}"
    assert status < 500, f"{where} {answer[:300]!r}"
    if status != 200 or choices is None:
        return
    if answer.startswith(b"data: "):  # a stream: a failure after the start is an event
        assert b'"type":"internal_error"' not in answer, f"{where} {answer[-300:]!r}"
        assert answer.endswith(b"data: [DONE]\n\n"), f"{where} {answer[-300:]!r}"
        events = [json.loads(e.removeprefix(b"data: ")) for e in answer.split(b"\n\n")[:-2]]
        if any("error" in e for e in events):
            return
        closed = [c["index"] for e in events for c in e["choices"] if c["finish_reason"] is not None]
        assert sorted(closed) == list(range(choices)), f"{where} closed {closed}, not {choices} choices"
    else:
        indices = [c["index"] for c in json.loads(answer)["choices"]]
        assert indices == list(range(choices)), f"{where} answered {indices}, not {choices} choices"


def _choices(kind: type, body: dict) -> int | None:
    """The choices an accepted `body` answers (prompts × n); None when the schema itself refuses it."""
    try:
        request = kind.model_validate(body)
    except Exception:  # any failure: the gateway refuses it too (its 400 is checked as any answer is)
        return None
    return request.prompt_count() * request.choices


def _json(value: dict) -> bytes:
    """`value` as JSON, lone surrogates escaped as JSON spells them (`\\ud800`)."""
    return json.dumps(value, ensure_ascii=True).encode()


@FUZZ
@given(body=COMPLETIONS)
@example(body={"model": "upper", "prompt": "\ud800"})
@example(body={"model": "upper", "prompt": PROMPT, "stop": ["\udfff"], "max_tokens": 2})
def test_fuzzed_completions_never_fail_internally(stack, body):
    check(stack, "/v1/completions", _json(body), _choices(CompletionRequest, body))


@FUZZ
@given(body=CHAT)
@example(body={"model": "upper", "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2})
@example(body={"model": "upper", "messages": [{"role": "user\udc80", "content": "hi"}], "max_tokens": 2})
def test_fuzzed_chat_completions_never_fail_internally(stack, body):
    check(stack, "/v1/chat/completions", _json(body), _choices(ChatCompletionRequest, body))


@FUZZ
@given(body=TOKENIZE)
@example(body={"prompt": "\ud800"})
@example(body={"prompt": PROMPT, "messages": [{"role": "user", "content": "hi"}]})
def test_fuzzed_tokenize_never_fails_internally(stack, body):
    check(stack, "/tokenize", _json(body))


@FUZZ
@given(body=DETOKENIZE)
@example(body={"tokens": [2**32]})
@example(body={"tokens": [1, 2**40]})
def test_fuzzed_detokenize_never_fails_internally(stack, body):
    check(stack, "/detokenize", _json(body))


@FUZZ
@given(body=ADAPTER_ROUTES)
@example(body=("/v1/load_lora_adapter", {"lora_name": "a\ud800", "lora_path": "upper"}))
def test_fuzzed_adapter_loads_never_fail_internally(stack, body):
    path, fields = body
    check(stack, path, _json(fields))


@FUZZ
@given(raw=RAW, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
@example(raw=DEEP, path="/v1/completions")
@example(raw=DEEP_SURROGATE, path="/v1/completions")
def test_raw_bodies_never_fail_internally(stack, raw, path):
    check(stack, path, raw)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "upper", "prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"model": "upper", "prompt": ["\udfff"]}, "prompt"),
        ("/v1/completions", {"model": "upper", "prompt": PROMPT, "stop": ["ok", "\ud800"]}, "stop"),
        ("/v1/completions", {"model": "upper\ud800", "prompt": PROMPT}, "model"),
        ("/v1/completions", {"model": "upper", "prompt": PROMPT, "user": "\ud800"}, "user"),
        ("/v1/chat/completions", {"model": "upper", "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "upper", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "upper", "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(stack, path, body, param):
    status, answer = send(stack, path, _json(body))
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", (status, error)
    assert "lone surrogate" in error["message"] and "UTF-8" in error["message"], error


def test_the_gateway_still_generates_afterwards(stack):
    status, answer = send(stack, "/v1/completions", _json({"model": "upper", "prompt": PROMPT, "max_tokens": 4}))
    assert status == 200 and json.loads(answer)["choices"][0]["text"], answer


def test_the_fuzzer_covers_every_field():
    """Every field of the request schemas is generated (and those refused by name, from their tables)."""
    for kind, generated in (
        (CompletionRequest, {*_COMPLETION_REQUIRED, *_COMPLETION_OPTIONAL}),
        (ChatCompletionRequest, {*_CHAT_REQUIRED, *_CHAT_OPTIONAL}),
    ):
        missing = set(kind.model_fields) - generated
        assert not missing, f"{kind.__name__}: the fuzzer never sets {sorted(missing)}"
