"""The body of POST /v1/responses (OpenAI's Responses API) as pydantic models, and what of it is refused.

Served (`responses_api.py` maps them onto the chat path): `model`, `input` (a string: one user message;
or a list of items: `message`s of role user, system, developer or assistant whose content is a string or
`input_text`/`output_text` parts, `function_call` items — earlier calls — and `function_call_output`
items — their results), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `tools` (function
tools), `tool_choice`, `parallel_tool_calls`, `max_tool_calls`, `text.format`, `metadata` (echoed back),
`user` and `stream`.

Everything else is refused by name (`unsupported()`), unless its value asks for nothing: null, false, an
empty string, list or object (an object of such values), or a value listed in `NOT_SERVED` (what loraserve
does anyway: `truncation: "disabled"`, `service_tier: "auto"`, ...). `NOT_SERVED` says why for the fields
OpenAI defines; an unknown field is "not supported" (OpenAI refuses unknown fields too), with the
Responses API's spelling for the chat completions fields sent here by mistake. The same rule holds inside
items, content parts, tools and `text`. Nothing is stored: `store: true`, `previous_response_id` and
`conversation` are refused, and a conversation is sent whole in `input`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from loraserve.gateway.http.schemas import UINT32_MAX, _Body
from loraserve.gateway.validation import MAX_END_USER_CHARS

NOT_SUPPORTED = "is not supported"
# Responses API fields loraserve does not serve: name -> (values besides null/false/empty that ask for nothing, why)
NOT_SERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((), "is not supported: responses are not stored; send the whole conversation in input"),
    "conversation": ((), "is not supported: conversations are not stored; send the whole conversation in input"),
    "store": ((), "is not supported: responses are not stored; send store: false or leave it out"),
    "background": ((), "is not supported: a response is answered while its request waits (stream it to read it early)"),
    "prompt": ((), "is not supported: no prompt templates are stored; send instructions and input"),
    "reasoning": (({"effort": "none"},), "is not supported: the model answers without a reasoning phase"),
    "include": ((), "is not supported: answers carry no extra data (no log-probabilities, sources or reasoning)"),
    "top_logprobs": ((0,), "is not supported: answers carry no log-probabilities"),
    "truncation": (("disabled",), "is not supported: an input longer than the context is refused, never truncated"),
    "service_tier": (("auto", "default"), "is not supported: one tier serves every request"),
    "prompt_cache_key": ((), "is not supported: prefix caching needs no key (a tenant's equal prefixes share it)"),
    "prompt_cache_retention": ((), "is not supported: cached prefixes are kept while memory allows"),
    "safety_identifier": ((), "is not supported: send user (the end user, recorded on the request's trace)"),
    "stream_options": ((), "is not supported: stream events are not obfuscated"),
    "max_tokens": ((), "is not a Responses API parameter: send max_output_tokens"),
    "max_completion_tokens": ((), "is not a Responses API parameter: send max_output_tokens"),
    "messages": ((), "is not a Responses API parameter: send input"),
    "response_format": ((), "is not a Responses API parameter: send text.format"),
}
ROLES = ("user", "system", "developer", "assistant")  # a message's
NON_TEXT = "is not served: only text (input_text and output_text parts), text models only"


def asks_for_nothing(value: Any, nothing: tuple[Any, ...] = ()) -> bool:
    """Whether `value` asks for nothing: null, false, empty, an object of such values, or one of `nothing`
    (an object compared without its null-valued keys; a bool only equal to a bool: `0` is not `False`)."""
    if value is None or value is False or value in ("", [], {}):
        return True
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if not asks_for_nothing(v)}
        if not value:
            return True
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in nothing)


def extra_refused(model: BaseModel, where: str = "") -> tuple[str, str] | None:
    """(parameter, why) for the first field of `model` beyond its declared ones that asks for something."""
    table = {} if where else NOT_SERVED  # the body's own fields: OpenAI's, each with its reason
    for name, value in (model.model_extra or {}).items():
        nothing, why = table.get(name, ((), NOT_SUPPORTED))
        if not asks_for_nothing(value, nothing):
            return f"{where}{name}", why
    return None


class _Open(BaseModel):
    """A part of the body whose undeclared fields are kept, to be refused unless they ask for nothing."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ContentPart(_Open):
    """A message's content part: `input_text` or `output_text` (an earlier answer's; its annotations and
    log-probabilities describe that answer and change nothing); any other type is refused."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    def refused(self, where: str) -> tuple[str, str] | None:
        if self.type not in ("input_text", "output_text"):
            return f"{where}.type", f"{self.type!r} {NON_TEXT}"
        if self.text is None:
            return f"{where}.text", "is missing"
        return extra_refused(self, f"{where}.")


Content = str | list[ContentPart]


def text_of(content: Content) -> str:
    """The text of a content (its parts' joined)."""
    return content if isinstance(content, str) else "".join(part.text or "" for part in content)


def _parts_refused(content: Content, where: str) -> tuple[str, str] | None:
    parts = () if isinstance(content, str) else content
    return next((r for i, p in enumerate(parts) if (r := p.refused(f"{where}[{i}]")) is not None), None)


class _Item(_Open):
    """An input item. `id` and `status` name and describe an earlier output item: they change nothing."""

    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def refused(self, where: str) -> tuple[str, str] | None:
        return extra_refused(self, f"{where}.")


class MessageItem(_Item):
    """A message (`type` may be left out). `phase` labels an earlier assistant message: it changes nothing."""

    type: Literal["message"] = "message"
    role: str
    content: Content
    phase: Literal["commentary", "final_answer"] | None = None

    def refused(self, where: str) -> tuple[str, str] | None:
        if self.role not in ROLES:
            why = "a tool's result is a function_call_output item" if self.role == "tool" else "is not a role"
            return f"{where}.role", f"{self.role!r}: {why} (roles: {', '.join(ROLES)})"
        return _parts_refused(self.content, f"{where}.content") or super().refused(where)


class FunctionCallItem(_Item):
    """A call the model made earlier."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content

    def refused(self, where: str) -> tuple[str, str] | None:
        return _parts_refused(self.output, f"{where}.output") or super().refused(where)


class OtherItem(_Open):
    """An item of any other type (reasoning, item references, built-in tools' calls): refused by name."""

    type: str

    def refused(self, where: str) -> tuple[str, str] | None:
        why = "is not served: input items are messages, function_call and function_call_output"
        if self.type == "item_reference":
            why = "is not served: items are not stored; send the item itself"
        return f"{where}.type", f"{self.type!r} {why}"


def _kind(known: tuple[str, ...], default: str | None = None):
    """A discriminator: an object's `type` when it is one of `known` (missing: `default`), else "other"."""

    def kind(value: Any) -> str | None:
        if isinstance(value, BaseModel):
            return value.type if value.type in known else "other"
        if not isinstance(value, dict):
            return None
        found = value.get("type", default)
        return found if found in known else "other"

    return kind


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_kind(("message", "function_call", "function_call_output"), "message")),
]


class FunctionTool(_Open):
    """A function tool. `strict` (null: true, the Responses API's default) holds `tool_choice: "auto"`'s
    calls to the arguments' schema, as chat's strict tools are."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def refused(self, where: str) -> tuple[str, str] | None:
        return extra_refused(self, f"{where}.")


class OtherTool(_Open):
    """A built-in tool (web_search, file_search, code_interpreter, mcp, ...): refused by name."""

    type: str

    def refused(self, where: str) -> tuple[str, str] | None:
        return f"{where}.type", f"{self.type!r} is not served: only function tools (loraserve runs no built-in tools)"


ToolItem = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
    Discriminator(_kind(("function",))),
]


class FunctionChoice(BaseModel):
    """`tool_choice: {"type": "function", "name": N}`: a call of N."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class OtherChoice(_Open):
    """Any other object (`allowed_tools`, a built-in tool, ...): refused."""

    type: str


ToolChoiceValue = Annotated[
    Annotated[FunctionChoice, Tag("function")] | Annotated[OtherChoice, Tag("other")],
    Discriminator(_kind(("function",))),
]


class TextFormat(_Open):
    """`text.format`: `text`, `json_object`, or `json_schema` with `name`, `schema`, `strict` (the schema is
    enforced whatever `strict` says) and `description`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def chat_format(self) -> dict[str, Any]:
        """The same format as chat's `response_format` spells it (`structured.requested_constraint` reads it)."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def refused(self) -> tuple[str, str] | None:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            return "text.format", "type 'json_schema' needs name and schema"
        return extra_refused(self, "text.format.")


class TextConfig(_Open):
    """`text`: its `format`; `verbosity` only at OpenAI's default, "medium" (the length is the model's)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.verbosity not in (None, "medium"):
            return "text.verbosity", "is not supported: bound the answer with max_output_tokens"
        return (self.format and self.format.refused()) or extra_refused(self, "text.")


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="allow")  # kept in model_extra, and refused there unless they ask for nothing

    model: str = Field(min_length=1)
    input: list[InputItem] | str  # the list first: what fails in an item is what a refusal reports
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ToolItem] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceValue | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None  # checked by `tool_calling.tool_choice` (1 to its MAX_TOOL_CALLS)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=MAX_END_USER_CHARS)  # the end user, recorded on the request's trace
    stream: bool | None = False

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"keys are at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE} ({key[:80]!r})"
                )
        return metadata

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """`input` as items (a string: one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)  # type: ignore[arg-type]  # OtherItem is refused by unsupported()

    def function_tools(self) -> list[FunctionTool]:
        return [t for t in self.tools or () if isinstance(t, FunctionTool)]

    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for the first thing asked for that loraserve does not serve; else None."""
        if self.top_p == 0:  # 0 is the gRPC API's "unset": refused rather than read as 1
            return "top_p", "must be in (0, 1], got 0 (for greedy decoding set temperature to 0)"
        if isinstance(self.input, list) and not self.input:
            return "input", "holds no items"
        if isinstance(self.tool_choice, OtherChoice):
            why = "only 'none', 'auto', 'required' or {'type': 'function', 'name': ...} (function tools only)"
            return "tool_choice", f"type {self.tool_choice.type!r} is not served: {why}"
        checks = (
            extra_refused(self),
            *(item.refused(f"input[{i}]") for i, item in enumerate(self.input if isinstance(self.input, list) else ())),
            *(tool.refused(f"tools[{i}]") for i, tool in enumerate(self.tools or ())),
            self.text.refused() if self.text is not None else None,
        )
        return next((refused for refused in checks if refused is not None), None)
