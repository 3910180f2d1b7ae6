"""Tool calling for the OpenAI chat API: parse a model's generated text into `tool_calls`.

Each model family writes tool calls its own way; `parser_named` picks the parser that the gateway's
`--tool-call-parser NAME` flag names. Text that does not hold well-formed calls is returned whole as
plain content, never as a partial guess — except a call that max_tokens cut short (`cut`): it comes
back as a call, its arguments as far as they were generated (what OpenAI answers), never as raw call
text in the content. Pure functions over strings: no I/O.

Each parser also writes its format as a grammar (`strict_grammar`, Lark in llguidance's dialect): free
text, or calls in the family's format whose arguments match their functions' schemas. That is what
`tool_choice: "auto"` with `strict` tools is constrained to: the model still chooses between text and
calls, but a call it begins can only end well-formed, with valid arguments (llguidance's lazy lexemes
let text run freely until a call's opening tag).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from loraserve.closed_schemas import close_objects


@dataclass(frozen=True)
class ToolCall:
    name: str
    # a JSON object, serialized with json.dumps(..., ensure_ascii=False); a cut call's: the text generated
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text that is not a tool call; None when empty or whitespace only
    tool_calls: list[ToolCall]  # empty: the text is plain content


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str, cut: bool = False, names: Collection[str] = ()) -> ParsedOutput:
        """The content and calls of `text`; `cut`: max_tokens ended it, so its last call may be cut short
        (`names`: the functions a call's cut name may complete to)."""
        ...

    def format_call(self, call: ToolCall) -> str: ...

    def strict_grammar(self, functions: dict[str, dict[str, Any]], max_calls: int) -> str:
        """The Lark grammar of free text with at most `max_calls` well-formed calls of `functions`."""
        ...


COMPACT = {"whitespace_flexible": False}  # JSON written compactly, as every other constrained JSON


def _arguments(schema: dict[str, Any]) -> str:
    """A function's arguments in Lark: a compact JSON value valid against `schema`, its objects closed
    (llguidance's %json)."""
    return "%json " + json.dumps({"x-guidance": COMPACT} | close_objects(schema))


def _literal(text: str) -> str:
    return json.dumps(text)


_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


def call_id() -> str:
    """A fresh id for one tool call of an OpenAI answer: "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _plain(text: str) -> ParsedOutput:
    return ParsedOutput(content=text if text.strip() else None, tool_calls=[])


def skip_space(text: str, pos: int) -> int:
    """Where the text after `pos`'s JSON whitespace begins."""
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


_NAME = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)'  # a call object's opening, up to its name (maybe cut)


def cut_call(text: str, keys: tuple[str, ...], names: Collection[str]) -> ToolCall | None:
    """The call that `text` (a call object, `{"name": N, KEY: ARGS`, cut short by max_tokens) begins: N,
    and ARGS as far as they were generated (none if the cut came before them). A name cut short is
    completed when exactly one of `names` begins with it; None when not even that much was written."""
    keyed = "|".join(re.escape(json.dumps(key)) for key in keys)
    whole = re.match(_NAME + rf'"\s*,\s*(?:{keyed})\s*:\s*', text)
    if whole is not None:
        return ToolCall(json.loads(f'"{whole.group(1)}"'), text[whole.end() :])
    named = re.match(_NAME + r'("?)\s*(?:,\s*"[^"]*)?$', text)  # the name, or the key after it, cut short
    if named is None:
        return None
    try:
        prefix = json.loads(f'"{named.group(1)}"')
    except ValueError:  # cut inside an escape
        return None
    if named.group(2):  # the name was written whole
        return ToolCall(prefix, "")
    found = [name for name in names if name.startswith(prefix)]
    return ToolCall(found[0], "") if len(found) == 1 else None


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

    def parse(self, text: str, cut: bool = False, names: Collection[str] = ()) -> ParsedOutput:
        pos = text.find(self.START)
        if pos < 0:
            return _plain(text)
        before = text[:pos].strip() or None
        calls: list[ToolCall] = []
        while pos >= 0:
            start = skip_space(text, pos + len(self.START))
            try:  # decode the JSON itself, so a "</tool_call>" inside a string value cannot cut it short
                obj, end = _DECODER.raw_decode(text, start)
            except ValueError:
                if not cut:
                    return _plain(text)
                partial = cut_call(text[start:], ("arguments",), names)
                return ParsedOutput(before, calls + ([partial] if partial else []))
            call = _to_call(obj, ("arguments",))
            end = skip_space(text, end)
            # closed, or unclosed at the very end (cut, or stopped, inside the closing tag)
            if call is None or not (text.startswith(self.END, end) or self.END.startswith(text[end:])):
                return _plain(text)
            calls.append(call)
            pos = text.find(self.START, end + len(self.END))
        return ParsedOutput(content=before, tool_calls=calls)

    def format_call(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}, ensure_ascii=False)
        return f"{self.START}\n{body}\n{self.END}"

    def strict_grammar(self, functions: dict[str, dict[str, Any]], max_calls: int) -> str:
        """Free text, with at most `max_calls` calls wherever the model opens `<tool_call>`:
        `<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>`, ARGS valid against N's schema. The
        text after the last call never holds `<tool_call>`: a call is well-formed or not written."""
        calls = " | ".join(f"call_{i}" for i in range(len(functions)))
        lines = ["%llguidance {}", f"start: ({calls}){{0,{max_calls}}} REST", r"TEXT: /(.|\n)*/"]
        lines.append(f"REST: /(.|\\n)*/ & ~/(.|\\n)*{re.escape(self.START)}(.|\\n)*/")
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

    def parse(self, text: str, cut: bool = False, names: Collection[str] = ()) -> ParsedOutput:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return _plain(text)
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except ValueError:
                if not cut:
                    return _plain(text)
                partial = cut_call(body[pos:], ("parameters", "arguments"), names)
                return ParsedOutput(None, calls + ([partial] if partial else []))
            pos = end
            call = _to_call(obj, ("parameters", "arguments"))
            if call is None:
                return _plain(text)
            calls.append(call)
            pos = skip_space(body, pos)
            if pos < len(body):
                if body[pos] != ";":
                    return _plain(text)
                pos = skip_space(body, pos + 1)
        return ParsedOutput(content=None, tool_calls=calls)

    def format_call(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "parameters": json.loads(call.arguments)}, ensure_ascii=False)

    def strict_grammar(self, functions: dict[str, dict[str, Any]], max_calls: int) -> str:
        """Text that does not begin with `{`, or 1 to `max_calls` calls from the start, joined by `; `:
        `{"name": N, "parameters": ARGS}`, ARGS valid against N's schema."""
        calls = " | ".join(f"call_{i}" for i in range(len(functions)))
        more = f' ("; " call){{0,{max_calls - 1}}}' if max_calls > 1 else ""
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
