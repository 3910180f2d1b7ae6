"""Tool calling on /v1/chat/completions: `tools` and `tool_choice`, and the answer's `tool_calls`.

What `tool_choice` does (the tools are given to the chat template as `tools` in every case, as
transformers' `apply_chat_template` does):

- `"none"`: the model answers in text; nothing is parsed.
- `"auto"` (the default with tools): the model writes freely; its text is parsed into tool calls by
  the model family's parser (`tool_parsers.py`), chosen with the gateway's `--tool-call-parser`.
  Without that flag `"auto"` is refused: the gateway cannot know how the model writes a call. With
  a tool marked `strict`, the output is constrained to the parser's grammar: free text, or calls in
  the family's format, each naming a given tool with arguments valid against its `parameters`.
- `"required"`: the output is constrained (structured output) to a JSON list of one or more calls,
  `[{"name": ..., "parameters": {...}}]`, each naming a given tool with arguments valid against its
  `parameters` schema (one call at most with `parallel_tool_calls: false`).
- `{"type": "function", "function": {"name": N}}`: the output is constrained to the arguments of N
  (a JSON object valid against its `parameters`), answered as one call of N.

The finish reason is `tool_calls` when calls were made under `auto` or `required`, `stop` under a
named function (OpenAI's answers), and `length` whenever max_tokens cut the output. Output that
does not hold well-formed calls (cut by max_tokens, or free text under `auto`) is answered as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loraserve.errors import InvalidRequestError
from loraserve.gateway.tool_parsers import ParsedOutput, ToolCall, ToolCallParser, call_id
from loraserve.structured import Constraint


@dataclass(frozen=True)
class ToolChoice:
    """How one request's tools are used: mode "auto", "required" or "function" (a named one)."""

    mode: str
    functions: dict[str, dict[str, Any]]  # name -> its `parameters` schema
    name: str | None = None  # mode "function": the function
    parser: ToolCallParser | None = None  # mode "auto"
    parallel: bool = True  # more than one call per answer
    strict: bool = False  # mode "auto": a tool is `strict`, so calls are held to the parser's grammar

    def constraint(self) -> Constraint | None:
        """The structured output this choice needs (compiled in the gateway's sandbox, as a body's own), or None."""
        if self.mode == "auto":
            if not self.strict:
                return None
            return Constraint("grammar", self.parser.strict_grammar(self.functions, self.parallel), "tools")
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
            schema = {"type": "array", "items": items, "minItems": 1} | ({} if self.parallel else {"maxItems": 1})
            return Constraint("json_schema", schema, "tool_choice")
        return None

    def parse(self, text: str) -> ParsedOutput:
        """The answer's content and tool calls, from the model's text."""
        if self.mode == "auto":
            parsed = self.parser.parse(text)
            return parsed if self.parallel else ParsedOutput(parsed.content, parsed.tool_calls[:1])
        try:
            value = json.loads(text)
        except ValueError:  # cut short by max_tokens
            return ParsedOutput(text or None, [])
        if self.mode == "function":
            return ParsedOutput(None, [ToolCall(self.name, json.dumps(value, ensure_ascii=False))])
        return ParsedOutput(None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value])

    def finish_reason(self, parsed: ParsedOutput, reason: str) -> str:
        if parsed.tool_calls and reason == "stop" and self.mode != "function":
            return "tool_calls"
        return reason


def tool_choice(
    tools: list[Any] | None, choice: Any, parallel: bool | None, parser: ToolCallParser | None
) -> ToolChoice | None:
    """The request's use of its tools; None when the model answers in text. InvalidRequestError naming
    `tools` or `tool_choice` for what cannot be served."""
    functions = {t.function.name: t.function.schema() for t in tools or ()}
    if len(functions) != len(tools or ()):
        raise InvalidRequestError("tools", "two tools have the same name")
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if not functions:
        raise InvalidRequestError("tool_choice", "needs tools")
    parallel = parallel is not False
    if choice == "auto":
        if parser is None:
            raise InvalidRequestError(
                "tool_choice",
                "'auto' needs the gateway's --tool-call-parser (how this model writes a call); "
                "'required' or a named function work without it",
            )
        strict = any(t.function.strict for t in tools)
        return ToolChoice("auto", functions, parser=parser, parallel=parallel, strict=strict)
    if choice == "required":
        return ToolChoice("required", functions, parallel=parallel)
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
