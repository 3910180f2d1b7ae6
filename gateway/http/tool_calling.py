"""Tool calling on /v1/chat/completions (the Responses API's through it): `tools` and `tool_choice`, and
the answer's `tool_calls` (the README's "Tools" says what each choice does for a client).

`"auto"` parses the model's free text with the family's parser (`tool_parsers.py`, the gateway's
`--tool-call-parser`), held to the parser's grammar when a tool is `strict`; `"required"` and a named
function constrain the output to a JSON list of calls, or to the function's arguments. Every grammar,
and the parsing of free text, bounds the calls in one answer (`MAX_TOOL_CALLS`, or the request's). A
call that max_tokens cut short is still answered as a call, its arguments as far as they were generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loraserve.errors import InvalidRequestError
from loraserve.gateway.tool_parsers import ParsedOutput, ToolCall, ToolCallParser, call_id, cut_call, skip_space
from loraserve.structured import Constraint

MAX_TOOL_CALLS = 16  # calls in one answer, whatever the request: a grammar never allows an endless list


@dataclass(frozen=True)
class ToolChoice:
    """How one request's tools are used: mode "auto", "required" or "function" (a named one)."""

    mode: str
    functions: dict[str, dict[str, Any]]  # name -> its `parameters` schema
    name: str | None = None  # mode "function": the function
    parser: ToolCallParser | None = None  # mode "auto"
    max_calls: int = MAX_TOOL_CALLS  # calls per answer: 1 without parallel calls
    strict: bool = False  # mode "auto": a tool is `strict`, so calls are held to the parser's grammar

    def constraint(self) -> Constraint | None:
        """The structured output this choice needs (compiled in the gateway's sandbox, as a body's own), or None."""
        if self.mode == "auto":
            if not self.strict:
                return None
            return Constraint("grammar", self.parser.strict_grammar(self.functions, self.max_calls), "tools")
        if self.mode == "function":
            return Constraint("json_schema", self.functions[self.name], "tool_choice")
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in self.functions.items()
            ]
            items = calls[0] if len(calls) == 1 else {"anyOf": calls}
            schema = {"type": "array", "items": items, "minItems": 1, "maxItems": self.max_calls}
            return Constraint("json_schema", schema, "tool_choice")
        return None

    def parse(self, text: str, cut: bool = False) -> ParsedOutput:
        """The answer's content and tool calls, from the model's text; `cut`: max_tokens ended it, so its
        last call may be cut short (answered with its arguments as generated)."""
        if self.mode == "auto":
            parsed = self.parser.parse(text, cut, self.functions)
            return ParsedOutput(parsed.content, parsed.tool_calls[: self.max_calls])
        if self.mode == "function":
            try:
                arguments = json.dumps(json.loads(text), ensure_ascii=False)
            except ValueError:  # cut short: the arguments as generated
                arguments = text
            return ParsedOutput(None, [ToolCall(self.name, arguments)])
        return ParsedOutput(None, _listed_calls(text, self.functions))

    def finish_reason(self, parsed: ParsedOutput, reason: str) -> str:
        if parsed.tool_calls and reason == "stop" and self.mode != "function":
            return "tool_calls"
        return reason


def _listed_calls(text: str, functions: dict[str, dict[str, Any]]) -> list[ToolCall]:
    """The calls of `required`'s JSON list, `[{"name": N, "parameters": ARGS}, ...]`, which max_tokens may
    have cut short: the whole calls, then the cut one (its arguments as generated) if its name was written."""
    decoder = json.JSONDecoder()
    calls = []
    pos = _after(text, 0, "[")
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            partial = cut_call(text[pos:], ("parameters",), functions)
            return calls + ([partial] if partial is not None else [])
        calls.append(ToolCall(value["name"], json.dumps(value["parameters"], ensure_ascii=False)))
        pos = _after(text, end, ",")
    return calls


def _after(text: str, pos: int, mark: str) -> int:
    """Where the next value begins: past whitespace, `mark` (if it comes next) and whitespace."""
    pos = skip_space(text, pos)
    return skip_space(text, pos + len(mark) if text.startswith(mark, pos) else pos)


def tool_choice(
    tools: list[Any] | None,
    choice: Any,
    parallel: bool | None,
    parser: ToolCallParser | None,
    max_calls: int | None = None,
) -> ToolChoice | None:
    """The request's use of its tools; None when the model answers in text. `max_calls`: the most calls
    in one answer (1 to MAX_TOOL_CALLS; unset: MAX_TOOL_CALLS), 1 when `parallel` is false.
    InvalidRequestError naming `tools`, `tool_choice` or `max_tool_calls` for what cannot be served."""
    if max_calls is not None and not 1 <= max_calls <= MAX_TOOL_CALLS:
        raise InvalidRequestError("max_tool_calls", f"must be in [1, {MAX_TOOL_CALLS}], got {max_calls}")
    functions = {t.function.name: t.function.schema() for t in tools or ()}
    if len(functions) != len(tools or ()):
        raise InvalidRequestError("tools", "two tools have the same name")
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if not functions:
        raise InvalidRequestError("tool_choice", "needs tools")
    max_calls = 1 if parallel is False else max_calls or MAX_TOOL_CALLS
    if choice == "auto":
        if parser is None:
            raise InvalidRequestError(
                "tool_choice",
                "'auto' needs the gateway's --tool-call-parser (how this model writes a call); "
                "'required' or a named function work without it",
            )
        strict = any(t.function.strict for t in tools)
        return ToolChoice("auto", functions, parser=parser, max_calls=max_calls, strict=strict)
    if choice == "required":
        return ToolChoice("required", functions, max_calls=max_calls)
    name = choice.function.name
    if name not in functions:
        raise InvalidRequestError(
            "tool_choice", f"names {name!r}, which is not among the tools ({', '.join(functions)})"
        )
    return ToolChoice("function", functions, name=name)


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls in an OpenAI answer's shape, each with a fresh id."""
    return [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]
