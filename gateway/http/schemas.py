"""The OpenAI request bodies, as pydantic models: types and ranges that the wire format needs.

Only what a field's type says is checked here (a pydantic failure is a 400 naming the parameter);
what the values mean (temperature ranges, context length, stop limits, adapter names) is checked by
the same struct and checks the gRPC API's requests get (`gateway/generation_request.py`), once the body
is a draft of its fields (`drafts.py`).
Structured output's fields (`response_format`, vLLM's `guided_*` and `structured_outputs`) are read by
`structured.py`. Tool calling's fields (`tools`, `tool_choice`, `parallel_tool_calls`) are read by `tool_calling.py`.
Fields OpenAI defines that loraserve does not serve (`logit_bias`, `suffix`) are accepted only at
their do-nothing values; `unsupported()` names any other. Unknown fields are ignored, as
OpenAI-compatible servers do, except the ones that ask for what loraserve does not do — vLLM's
extensions it does not implement and OpenAI's fields for other features (the tables of
`refusals.py`): those are accepted only at the values that ask for nothing (null, or what loraserve
does anyway) and refused by name otherwise.
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens` and `cache_salt` are extensions (vLLM's names). `user` (OpenAI's end-user id)
goes on the request's trace, as the gRPC metadata `x-loraserve-end-user` does.
Every string anywhere in a body (values and keys, known fields or not) must be Unicode text: JSON can
spell a lone surrogate (`"\\ud800"`), which no UTF-8 encoder takes, and such a body is refused whole
(`invalid_unicode`, naming where the surrogate is) before any field is looked at.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from loraserve.gateway.generation_request import MAX_CLIENT_ID
from loraserve.gateway.http.drafts import sampling_fields
from loraserve.gateway.http.refusals import (
    CHAT_NOT_IMPLEMENTED,
    COMPLETION_NOT_IMPLEMENTED,
    NOT_IMPLEMENTED,
    NOT_SUPPORTED,
    asks_for_nothing,
)
from loraserve.gateway.validation import MAX_END_USER_CHARS
from loraserve.params import MAX_LOGPROBS

UINT32_MAX = 2**32 - 1
MAX_PROMPTS = 64  # prompts in one completions request (each is scheduled as a request of its own)
MAX_GENERATIONS = 64  # generations of one request: prompts × choices (n, or best_of candidates)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; 0 is greedy
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
INVALID_UNICODE = "invalid_unicode"  # the pydantic error type of a body holding a lone surrogate


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


def _printable(text: str) -> str:
    """`text` with any surrogate written as its escape (`\\ud800`), safe to put in an answer."""
    return text.encode("utf-8", "backslashreplace").decode()


class StreamOptions(BaseModel):
    """`stream_options`: every field vLLM accepts. Unknown fields are refused (they would ask for
    something loraserve cannot know how to do)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False  # a last chunk with the usage (summed over the choices)
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries its choice's usage so far


CONSTRAINT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "structured_outputs",
)


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
    def new_tokens(self) -> int:
        """max_tokens; 0 (unset) means the gateway's default."""
        return self.max_tokens or 0

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
            "keep_special_tokens": self.skip_special_tokens is False,
        }

    def constraint_fields(self) -> dict[str, Any]:
        """The fields that may ask for structured output (`structured.requested_constraint` reads them)."""
        return {name: getattr(self, name) for name in CONSTRAINT_FIELDS}

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

    not_implemented: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = NOT_IMPLEMENTED  # and the endpoint's

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for the first parameter set to something loraserve does not do; else None."""
        extra = self.model_extra or {}
        generations = self.prompt_count() * self.candidates
        stream_options = self.stream_options
        refusals = [
            (
                generations > MAX_GENERATIONS,
                "best_of" if self.candidates > self.choices else "n",
                f"a request runs at most {MAX_GENERATIONS} generations (prompts × choices), got {generations}",
            ),
            # 0 is the gRPC API's "unset" for these two: refused here rather than read as 1
            (self.top_p == 0, "top_p", "must be in (0, 1], got 0 (for greedy decoding set temperature to 0)"),
            (self.repetition_penalty == 0, "repetition_penalty", "must be in [0.01, 10] (1 turns it off), got 0"),
            *(
                (name in extra and not asks_for_nothing(extra[name], nothing), name, why)
                for name, (nothing, why) in self.not_implemented.items()
            ),
            (bool(self.logit_bias), "logit_bias", NOT_SUPPORTED),
            (stream_options is not None and not self.stream, "stream_options", "needs stream: true"),
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

    not_implemented: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = NOT_IMPLEMENTED | COMPLETION_NOT_IMPLEMENTED

    def logprob_fields(self) -> dict[str, int]:
        if self.logprobs is None:
            return {}
        return {"logprobs": self.logprobs} | ({"prompt_logprobs": self.logprobs} if self.echo else {})

    @property
    def prompt_only(self) -> bool:
        """`max_tokens: 0` with echo: the prompt's text and log-probabilities, nothing generated (one
        token is, to score the prompt: the answer leaves it out)."""
        return self.max_tokens == 0

    @property
    def new_tokens(self) -> int:
        return 1 if self.prompt_only else super().new_tokens

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
            return "suffix", "is not supported"
        return super().unsupported()

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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: no arguments
    strict: bool | None = None  # the arguments are always held to `parameters` when the output is constrained

    def schema(self) -> dict[str, Any]:
        """The arguments' schema (no parameters: an empty object)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

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

    not_implemented: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = NOT_IMPLEMENTED | CHAT_NOT_IMPLEMENTED

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


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, min_length=1)
    tokens: list[TokenId]


class LoadLoraAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's shape; adapters are named, `lora_int_id` is refused)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
