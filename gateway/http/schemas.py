"""The one schema module of the HTTP edge: the OpenAI request bodies as pydantic models (completions, chat
completions, the Responses API, the operational routes), and what of them is refused (the README's HTTP
API section lists every field served and every refusal).

Only what a field's type says is checked here (a pydantic failure is a 400 naming the parameter); what the
values mean is checked by the struct and checks the gRPC API's requests get (`gateway/generation_request.py`),
once the body is a draft of its fields (`drafts.py`). A body holding a lone surrogate (`"\\ud800"`, which
JSON can spell and no UTF-8 encoder takes) anywhere is refused whole (`invalid_unicode`).

Refusals: completions and chat ignore unknown fields, as OpenAI-compatible servers do, but refuse by name
the ones that ask for what loraserve does not do (`NOT_IMPLEMENTED` and the endpoints' tables) unless at a
value that asks for nothing. The Responses API serves the fields `ResponsesRequest` declares and refuses
everything else (inside items, parts, tools and `text` too) unless it asks for nothing (`NOT_SERVED` says
why for the fields OpenAI defines).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from loraserve.gateway.generation_request import MAX_CLIENT_ID
from loraserve.gateway.http.drafts import sampling_fields
from loraserve.gateway.http.structured import CONSTRAINT_FIELDS
from loraserve.gateway.validation import MAX_END_USER_CHARS
from loraserve.params import MAX_LOGPROBS

UINT32_MAX = 2**32 - 1
MAX_PROMPTS = 64  # prompts in one completions request (each is scheduled as a request of its own)
MAX_GENERATIONS = 64  # generations of one request: prompts × choices (n, or best_of candidates)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; 0 is greedy
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
Identifier = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function names
INVALID_UNICODE = "invalid_unicode"  # the pydantic error type of a body holding a lone surrogate
TOP_P_ZERO = "must be in (0, 1], got 0 (for greedy decoding set temperature to 0)"  # 0: the gRPC API's "unset"

# ---- refusals ---------------------------------------------------------------------------------------
NOT_SUPPORTED = "is not supported"
Refusals = dict[str, tuple[tuple[Any, ...], str]]  # name -> (the values besides null that ask for nothing, why)
NOT_IMPLEMENTED: Refusals = {  # completions and chat
    # vLLM's sampling and text extensions
    "min_tokens": ((0,), NOT_SUPPORTED),
    "use_beam_search": ((False,), NOT_SUPPORTED),
    "length_penalty": ((1,), NOT_SUPPORTED),
    "bad_words": (([],), NOT_SUPPORTED),
    "allowed_token_ids": ((), NOT_SUPPORTED),
    "logits_processors": (([],), NOT_SUPPORTED),
    "prompt_logprobs": ((), "is not supported: prompt log-probabilities come with echo (completions)"),
    "truncate_prompt_tokens": ((), NOT_SUPPORTED),
    "spaces_between_special_tokens": ((), NOT_SUPPORTED),
    "return_tokens_as_token_ids": ((False,), NOT_SUPPORTED),
    "guided_whitespace_pattern": ((), "is not supported: JSON is written compactly"),
    "priority": ((0,), "is not supported: requests are scheduled by tenant fairness and deadlines"),
    # OpenAI's
    "prediction": ((), "is not supported (predicted outputs)"),
    "store": ((False,), "is not supported: loraserve keeps no completions"),
}
CHAT_NOT_IMPLEMENTED: Refusals = {
    "functions": (([],), "is not supported: use tools"),
    "function_call": ((), "is not supported: use tool_choice"),
    "audio": ((), "is not supported: text models only"),
    "modalities": ((["text"],), "is not supported: text models only"),
    "web_search_options": ((), NOT_SUPPORTED),
    "reasoning_effort": ((), NOT_SUPPORTED),
    # vLLM's chat extensions
    "echo": ((False,), "is not supported in chat (completions have it)"),
    "add_generation_prompt": ((True,), "is not supported: the template always opens the assistant's turn"),
    "continue_final_message": ((False,), NOT_SUPPORTED),
    "add_special_tokens": ((False,), "is not supported: the chat template writes the special tokens"),
    "chat_template": ((), "is not supported: the model's own template renders every conversation"),
    "chat_template_kwargs": (({},), NOT_SUPPORTED),
    "documents": ((), NOT_SUPPORTED),
}
COMPLETION_NOT_IMPLEMENTED: Refusals = {
    "add_special_tokens": ((True,), "is not supported: a text prompt begins with BOS (send token ids to choose)"),
    "prompt_embeds": ((), NOT_SUPPORTED),
}
NOT_SERVED: Refusals = {  # the Responses API's fields (besides false and empty values, which ask for nothing)
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


def asks_for_nothing(value: Any, nothing: tuple[Any, ...] = (), empty: bool = False) -> bool:
    """Whether `value` is null or one of `nothing` (a bool only equal to a bool: `0` is not `False`); with
    `empty` (the Responses API's rule) also false, empty, or an object of such values (an object is compared
    with `nothing` without its keys that ask for nothing)."""
    if value is None:
        return True
    if empty and (value is False or value in ("", [], {})):
        return True
    if empty and isinstance(value, dict):
        value = {k: v for k, v in value.items() if not asks_for_nothing(v, empty=True)}
        if not value:
            return True
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in nothing)


# ---- every body -------------------------------------------------------------------------------------
def lone_surrogate(value: Any) -> tuple[list[str | int], str, bool] | None:
    """(path, character, in a key) of a string in `value` (JSON as Python: dicts, lists, scalars) that
    holds a lone surrogate; None when every string is Unicode text. The walk keeps its own stack: a
    deeply nested body cannot exhaust Python's."""
    pending: list[tuple[list[str | int], Any]] = [([], value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            bad = _surrogate(item)
            if bad is not None:
                return path, bad, False
        elif isinstance(item, dict):
            for key, child in item.items():
                bad = _surrogate(key) if isinstance(key, str) else None
                if bad is not None:
                    return [*path, key], bad, True
                pending.append(([*path, key], child))
        elif isinstance(item, list):
            pending.extend(([*path, i], child) for i, child in reversed(list(enumerate(item))))
    return None


def _surrogate(text: str) -> str | None:
    try:
        text.encode()
    except UnicodeEncodeError as e:
        return text[e.start]
    return None


def _printable(text: str) -> str:
    """`text` with any surrogate written as its escape (`\\ud800`), safe to put in an answer."""
    return text.encode("utf-8", "backslashreplace").decode()


class _Body(BaseModel):
    """A request body: refused whole when any string in it is not Unicode text."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found is not None:
            path, char, in_key = found
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{_printable(p)}" for p in path).lstrip(".")
            where = f"the key {where}" if in_key else where
            param = path[0] if path and isinstance(path[0], str) and _surrogate(path[0]) is None else "body"
            raise PydanticCustomError(
                INVALID_UNICODE,
                "holds a lone surrogate ({char}) at {where}, which is not Unicode text: send valid UTF-8 "
                "(a character beyond U+FFFF as one surrogate pair)",
                {"char": _printable(char), "where": where or "body", "param": param},
            )
        return data


# ---- completions and chat completions -------------------------------------------------------------
class StreamOptions(BaseModel):
    """`stream_options`: every field vLLM accepts. Unknown fields are refused (they would ask for
    something loraserve cannot know how to do)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False  # a last chunk with the usage (summed over the choices)
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries its choice's usage so far


class _Generation(_Body):
    """The parameters completions and chat completions share."""

    model_config = ConfigDict(extra="allow")  # kept in model_extra: the refused extensions are looked for there

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = Field(None, ge=1, le=MAX_GENERATIONS)  # choices per prompt, sharing its prefill
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_END_USER_CHARS)  # the end user, recorded on the request's trace
    logit_bias: dict[str, float] | None = None
    top_k: int | None = Field(None, ge=-1, le=UINT32_MAX)  # extension; -1 or 0: off (vLLM's -1)
    repetition_penalty: float | None = None  # extension
    ignore_eos: bool | None = None  # extension: generate max_tokens whatever the model says
    stop_token_ids: list[TokenId] | None = None  # extension: token ids that end the generation
    min_p: float | None = None  # extension: drop tokens less likely than min_p times the most likely one
    include_stop_str_in_output: bool | None = None  # extension: keep the stop sequence at the text's end
    skip_special_tokens: bool | None = None  # extension: false keeps special tokens' text in the text
    # Structured output (`structured.py`): OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # extension (vLLM's): cached KV shared only within it
    cache_salt: str | None = Field(None, max_length=MAX_CLIENT_ID)

    not_implemented: ClassVar[Refusals] = NOT_IMPLEMENTED  # and the endpoint's
    prompt_only: ClassVar[bool] = False  # completions' `max_tokens: 0` with echo (`CompletionRequest`)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)

    @property
    def keep_special_tokens(self) -> bool:
        return self.skip_special_tokens is False

    @property
    def new_tokens(self) -> int:
        """max_tokens; 0 (unset) means the gateway's default."""
        return self.max_tokens or 0

    @property
    def choices(self) -> int:
        """Choices per prompt (n)."""
        return self.n or 1

    @property
    def candidates(self) -> int:
        """Generations per prompt: n, or best_of (the n best of them are answered)."""
        return self.choices

    def prompt_count(self) -> int:
        return 1

    def sampling(self) -> dict[str, Any]:
        """The sampling fields of this request, by their `SamplingParams` names (as the gRPC API's
        SamplingParameters names them too)."""
        fields: dict[str, Any] = {
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k in (None, -1) else self.top_k,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "ignore_eos": bool(self.ignore_eos),
            "min_p": self.min_p or 0.0,
        }
        if self.seed is not None:
            fields["seed"] = self.seed
        return fields | self.logprob_fields()

    def logprob_fields(self) -> dict[str, int]:
        """The log-probability sampling fields this request asks for."""
        return {}

    def generation_fields(self) -> dict[str, Any]:
        """This body as a generation's fields (`gateway/generation_request.py`, read as the gRPC API reads
        its own, `drafts.sampling_fields`), but for its adapter and output constraint, which the route works
        out (from the model id, the constraint fields and the tool choice)."""
        return {
            "sampling": sampling_fields(self.sampling(), self.new_tokens, self.stop_token_ids or ()),
            "stop": self.stops,
            "include_stop": bool(self.include_stop_str_in_output),
            "cache_salt": self.cache_salt or "",
            "keep_special_tokens": self.keep_special_tokens,
        }

    def constraint_fields(self) -> dict[str, Any]:
        """The fields that may ask for structured output (`structured.requested_constraint` reads them)."""
        return {name: getattr(self, name) for name in CONSTRAINT_FIELDS}

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for the first parameter set to something loraserve does not do; else None."""
        extra = self.model_extra or {}
        generations = self.prompt_count() * self.candidates
        refusals = [
            (
                generations > MAX_GENERATIONS,
                "best_of" if self.candidates > self.choices else "n",
                f"a request runs at most {MAX_GENERATIONS} generations (prompts × choices), got {generations}",
            ),
            # 0 is the gRPC API's "unset" for these two: refused here rather than read as 1
            (self.top_p == 0, "top_p", TOP_P_ZERO),
            (self.repetition_penalty == 0, "repetition_penalty", "must be in [0.01, 10] (1 turns it off), got 0"),
            *(
                (name in extra and not asks_for_nothing(extra[name], nothing), name, why)
                for name, (nothing, why) in self.not_implemented.items()
            ),
            (bool(self.logit_bias), "logit_bias", NOT_SUPPORTED),
            (self.stream_options is not None and not self.stream, "stream_options", "needs stream: true"),
        ]
        return next(((name, why) for refused, name, why in refusals if refused), None)


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(None, ge=0, le=UINT32_MAX)  # 0: with echo, the prompt scored alone
    echo: bool | None = False  # the answer's text (and log-probabilities) begin with the prompt's
    best_of: int | None = Field(None, ge=1, le=MAX_GENERATIONS)  # candidates per prompt: the n likeliest are answered
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # per token: its own and the k most likely
    suffix: str | None = None

    not_implemented: ClassVar[Refusals] = NOT_IMPLEMENTED | COMPLETION_NOT_IMPLEMENTED

    def logprob_fields(self) -> dict[str, int]:
        if self.logprobs is None:
            return {}
        return {"logprobs": self.logprobs} | ({"prompt_logprobs": self.logprobs} if self.echo else {})

    @property
    def prompt_only(self) -> bool:  # type: ignore[override]
        """`max_tokens: 0` with echo: the prompt's text and log-probabilities, nothing generated (one
        token is, to score the prompt: the answer leaves it out)."""
        return self.max_tokens == 0

    @property
    def new_tokens(self) -> int:
        return 1 if self.prompt_only else super().new_tokens

    @property
    def candidates(self) -> int:
        return self.best_of or self.choices

    def prompt_count(self) -> int:
        return len(self.prompt_values())

    def prompt_values(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: one, or a batch (a list of either)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "must be at least 1 (0 only with echo: the prompt scored, nothing generated)"
        if len(self.prompt_values()) > MAX_PROMPTS:
            return "prompt", f"a batch holds at most {MAX_PROMPTS} prompts, got {len(self.prompt_values())}"
        if self.best_of is not None and self.best_of < self.choices:
            return "best_of", f"must be at least n ({self.choices}), got {self.best_of}"
        if self.stream and self.candidates > self.choices:
            return "best_of", "cannot be streamed when above n (the best are known only at the end)"
        if self.suffix:
            return "suffix", NOT_SUPPORTED
        return super().unsupported()


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    name: Identifier
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: no arguments
    strict: bool | None = None  # the arguments are always held to `parameters` when the output is constrained

    def schema(self) -> dict[str, Any]:
        """The arguments' schema (no parameters: an empty object)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(BaseModel):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def text(self) -> str | None:
        """The message's text (text parts joined); None if a part is not text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            return None
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    not_implemented: ClassVar[Refusals] = NOT_IMPLEMENTED | CHAT_NOT_IMPLEMENTED

    @property
    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 0

    def logprob_fields(self) -> dict[str, int]:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "needs logprobs: true"
        for i, message in enumerate(self.messages):
            if message.text() is None:
                return f"messages[{i}].content", "only text content parts are supported"
        return super().unsupported()

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them: role, content text (and name, tool calls and the
    call a tool answers, when given; a call's arguments as an object, as transformers' templates read them)."""
    out = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text() or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls is not None:
            entry["tool_calls"] = [_template_call(c) for c in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return call | {"function": function | {"arguments": arguments}}


# ---- the Responses API ----------------------------------------------------------------------------
ROLES = ("user", "system", "developer", "assistant")  # a message's
NON_TEXT = "is not served: only text (input_text and output_text parts), text models only"


class _Open(BaseModel):
    """A part of a Responses API body whose undeclared fields are kept, to be refused unless they ask for
    nothing (`refused`; the body's own fields by `NOT_SERVED`, with its reasons)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    not_served: ClassVar[Refusals] = {}

    def refused(self, where: str) -> tuple[str, str] | None:
        """(parameter, why) for the first field beyond the declared ones that asks for something; `where`:
        this part's place in the body (`input[0].`, `text.`)."""
        for name, value in (self.model_extra or {}).items():
            nothing, why = self.not_served.get(name, ((), NOT_SUPPORTED))
            if not asks_for_nothing(value, nothing, empty=True):
                return f"{where}{name}", why
        return None


class InputPart(_Open):
    """A message's content part: `input_text` or `output_text` (an earlier answer's; its annotations and
    log-probabilities describe that answer and change nothing); any other type is refused."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    def refused(self, where: str) -> tuple[str, str] | None:
        if self.type not in ("input_text", "output_text"):
            return f"{where}type", f"{self.type!r} {NON_TEXT}"
        if self.text is None:
            return f"{where}text", "is missing"
        return super().refused(where)


Content = str | list[InputPart]


def text_of(content: Content) -> str:
    """The text of a content (its parts' joined)."""
    return content if isinstance(content, str) else "".join(part.text or "" for part in content)


def _parts_refused(content: Content, where: str) -> tuple[str, str] | None:
    parts = () if isinstance(content, str) else content
    return next((r for i, p in enumerate(parts) if (r := p.refused(f"{where}[{i}].")) is not None), None)


class _Item(_Open):
    """An input item. `id` and `status` name and describe an earlier output item: they change nothing."""

    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class MessageItem(_Item):
    """A message (`type` may be left out). `phase` labels an earlier assistant message: it changes nothing."""

    type: Literal["message"] = "message"
    role: str
    content: Content
    phase: Literal["commentary", "final_answer"] | None = None

    def refused(self, where: str) -> tuple[str, str] | None:
        if self.role not in ROLES:
            why = "a tool's result is a function_call_output item" if self.role == "tool" else "is not a role"
            return f"{where}role", f"{self.role!r}: {why} (roles: {', '.join(ROLES)})"
        return _parts_refused(self.content, f"{where}content") or super().refused(where)


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
        return _parts_refused(self.output, f"{where}output") or super().refused(where)


class OtherItem(_Open):
    """An item of any other type (reasoning, item references, built-in tools' calls): refused by name."""

    type: str

    def refused(self, where: str) -> tuple[str, str] | None:
        why = "is not served: input items are messages, function_call and function_call_output"
        if self.type == "item_reference":
            why = "is not served: items are not stored; send the item itself"
        return f"{where}type", f"{self.type!r} {why}"


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


class FunctionTool(_Open, FunctionDefinition):
    """A function tool: chat's function, flat. `strict` (null: true, the Responses API's default) holds
    `tool_choice: "auto"`'s calls to the arguments' schema, as chat's strict tools are."""

    type: Literal["function"]


class OtherTool(_Open):
    """A built-in tool (web_search, file_search, code_interpreter, mcp, ...): refused by name."""

    type: str

    def refused(self, where: str) -> tuple[str, str] | None:
        return f"{where}type", f"{self.type!r} is not served: only function tools (loraserve runs no built-in tools)"


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
    name: Identifier | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def chat_format(self) -> dict[str, Any]:
        """The same format as chat's `response_format` spells it (`structured.requested_constraint` reads it)."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def refused(self, where: str) -> tuple[str, str] | None:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            return "text.format", "type 'json_schema' needs name and schema"
        return super().refused(where)


class TextConfig(_Open):
    """`text`: its `format`; `verbosity` only at OpenAI's default, "medium" (the length is the model's)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def refused(self, where: str) -> tuple[str, str] | None:
        if self.verbosity not in (None, "medium"):
            return "text.verbosity", "is not supported: bound the answer with max_output_tokens"
        return (self.format and self.format.refused("text.format.")) or super().refused(where)


MetadataKey = Annotated[str, Field(max_length=64)]  # OpenAI's bounds: 16 pairs, keys of 64 characters,
MetadataValue = Annotated[str, Field(max_length=512)]  # values of 512


class ResponsesRequest(_Body, _Open):
    """POST /v1/responses."""

    not_served: ClassVar[Refusals] = NOT_SERVED

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
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    user: str | None = Field(None, max_length=MAX_END_USER_CHARS)  # the end user, recorded on the request's trace
    stream: bool | None = False

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """`input` as items (a string: one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)  # type: ignore[arg-type]  # OtherItem is refused by unsupported()

    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for the first thing asked for that loraserve does not serve; else None."""
        if self.top_p == 0:
            return "top_p", TOP_P_ZERO
        if isinstance(self.input, list) and not self.input:
            return "input", "holds no items"
        if isinstance(self.tool_choice, OtherChoice):
            why = "only 'none', 'auto', 'required' or {'type': 'function', 'name': ...} (function tools only)"
            return "tool_choice", f"type {self.tool_choice.type!r} is not served: {why}"
        checks = (
            self.refused(""),
            *(
                item.refused(f"input[{i}].")
                for i, item in enumerate(self.input if isinstance(self.input, list) else ())
            ),
            *(tool.refused(f"tools[{i}].") for i, tool in enumerate(self.tools or ())),
            self.text.refused("text.") if self.text is not None else None,
        )
        return next((refused for refused in checks if refused is not None), None)


# ---- the operational routes (vLLM's shapes) --------------------------------------------------------
class TokenizeRequest(_Body):
    """POST /tokenize: a prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = Field(None, min_length=1)
    tokens: list[TokenId]


class LoadLoraAdapterRequest(_Body):
    """POST /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (adapters are named, `lora_int_id` is refused)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
