"""Tool calling for the OpenAI chat API: parse a model's generated text into `tool_calls`.

Each model family writes tool calls its own way; `parser_named` picks the parser that the gateway's
`--tool-call-parser NAME` flag names. Text that does not hold well-formed calls is returned whole as
plain content, never as a partial guess. Pure functions over strings: no I/O.

Each parser also writes its format as a grammar (`strict_grammar`, Lark in llguidance's dialect): free
text, or calls in the family's format whose arguments match their functions' schemas. That is what
`tool_choice: "auto"` with `strict` tools is constrained to: the model still chooses between text and
calls, but a call it begins can only end well-formed, with valid arguments (llguidance's lazy lexemes
let text run freely until a call's opening tag).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialized with json.dumps(..., ensure_ascii=False)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text that is not a tool call; None when empty or whitespace only
    tool_calls: list[ToolCall]  # empty: the text is plain content


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedOutput: ...

    def format_call(self, call: ToolCall) -> str: ...

    def strict_grammar(self, functions: dict[str, dict[str, Any]], parallel: bool) -> str: ...


COMPACT = {"whitespace_flexible": False}  # JSON written compactly, as every other constrained JSON


def _arguments(schema: dict[str, Any]) -> str:
    """A function's arguments in Lark: a compact JSON value valid against `schema` (llguidance's %json)."""
    return "%json " + json.dumps({"x-guidance": COMPACT} | schema)


def _literal(text: str) -> str:
    return json.dumps(text)


_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


def call_id() -> str:
    """A fresh id for one tool call of an OpenAI answer: "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _plain(text: str) -> ParsedOutput:
    return ParsedOutput(content=text if text.strip() else None, tool_calls=[])


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _to_call(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """The call a decoded JSON object describes, its arguments under the first of `keys` present; None if malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[key] for key in keys if key in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string holding the object
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Hermes 2/3 and Qwen 2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedOutput:
        pos = text.find(self.START)
        if pos < 0:
            return _plain(text)
        before = text[:pos].strip()
        calls: list[ToolCall] = []
        while pos >= 0:
            try:  # decode the JSON itself, so a "</tool_call>" inside a string value cannot cut it short
                obj, end = _DECODER.raw_decode(text, _skip_space(text, pos + len(self.START)))
            except ValueError:
                return _plain(text)
            call = _to_call(obj, ("arguments",))
            end = _skip_space(text, end)
            if call is None or not (text.startswith(self.END, end) or end == len(text)):  # unclosed only if cut
                return _plain(text)
            calls.append(call)
            pos = text.find(self.START, end + len(self.END))
        return ParsedOutput(content=before or None, tool_calls=calls)

    def format_call(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}, ensure_ascii=False)
        return f"{self.START}\n{body}\n{self.END}"

    def strict_grammar(self, functions: dict[str, dict[str, Any]], parallel: bool) -> str:
        """Free text, with calls (at most one unless `parallel`) wherever the model opens `<tool_call>`:
        `<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>`, ARGS valid against N's schema."""
        calls = " | ".join(f"call_{i}" for i in range(len(functions)))
        lines = ["%llguidance {}", f"start: ({calls}){'*' if parallel else '?'} TEXT", r"TEXT: /(.|\n)*/"]
        closing = "}\n" + self.END
        for i, (name, schema) in enumerate(functions.items()):
            opening = "\n" + json.dumps({"name": name}, ensure_ascii=False)[:-1] + ', "arguments": '
            lines += [
                f"call_{i}_open[lazy]: TEXT {_literal(self.START)}",
                f"call_{i}: call_{i}_open {_literal(opening)} {_arguments(schema)} {_literal(closing)}",
            ]
        return "\n".join(lines) + "\n"


class Llama3JsonParser:
    """Llama 3.1/3.2 JSON tool calling: `{"name": ..., "parameters": {...}}`, several joined by `;`."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return _plain(text)
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, pos = _DECODER.raw_decode(body, pos)
            except ValueError:
                return _plain(text)
            call = _to_call(obj, ("parameters", "arguments"))
            if call is None:
                return _plain(text)
            calls.append(call)
            pos = _skip_space(body, pos)
            if pos < len(body):
                if body[pos] != ";":
                    return _plain(text)
                pos = _skip_space(body, pos + 1)
        return ParsedOutput(content=None, tool_calls=calls)

    def format_call(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "parameters": json.loads(call.arguments)}, ensure_ascii=False)

    def strict_grammar(self, functions: dict[str, dict[str, Any]], parallel: bool) -> str:
        """Text that does not begin with `{`, or calls from the start (several joined by `; ` when
        `parallel`): `{"name": N, "parameters": ARGS}`, ARGS valid against N's schema."""
        calls = " | ".join(f"call_{i}" for i in range(len(functions)))
        more = ' ("; " call)*' if parallel else ""
        lines = ["%llguidance {}", f"start: TEXT | SPACE? call{more}", f"call: {calls}"]
        lines += [r"TEXT: /[ \t\r\n]*([^ \t\r\n{](.|\n)*)?/", r"SPACE: /[ \t\r\n]+/"]
        for i, (name, schema) in enumerate(functions.items()):
            opening = json.dumps({"name": name}, ensure_ascii=False)[:-1] + ', "parameters": '
            lines.append(f"call_{i}: {_literal(opening)} {_arguments(schema)} {_literal('}')}")
        return "\n".join(lines) + "\n"


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_named(name: str) -> ToolCallParser:
    """The parser the `--tool-call-parser` flag names; ValueError naming the known ones otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


TOOL_CALL_PARSER_HELP = (
    "how the model writes tool calls, for chat tool_choice 'auto' (hermes: Hermes/Qwen <tool_call> "
    "tags; llama3_json: Llama 3.1+ JSON); unset: 'auto' is refused ('required' and named functions work)"
)
