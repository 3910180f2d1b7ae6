"""The OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/v1/responses`
(the operational ones are `operations.py`'s).

A model id is an adapter's name as the caller sees it (`gateway/namespaces.py`), or the base model's.
A request becomes one draft per choice (`drafts.py`), which `answering.py` has the generation core run
and answers in the API's shape; failures leave in OpenAI's error shape (`errors.py`). Chat renders
`messages` with the model's chat template and sends the token ids (both in the tokenizer's threads);
the Responses API becomes the chat completion it asks for (`responses_api.py`). `BodyGuard` stands in
front of every route (401 and 413 before any byte of the body is read).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraserve.errors import AdapterNotFoundError, InvalidRequestError, LoraserveError
from loraserve.gateway.admin_service import AdapterAdminService
from loraserve.gateway.auth import Principal
from loraserve.gateway.chat_template import ChatTemplate
from loraserve.gateway.core import GenerationCore
from loraserve.gateway.generation_request import Fields
from loraserve.gateway.http import responses_api
from loraserve.gateway.http.answering import answer, http_metadata
from loraserve.gateway.http.body_guard import BodyGuard
from loraserve.gateway.http.errors import (
    CHAT_PARAMS,
    PARAMS,
    RESPONSES_PARAMS,
    HttpError,
    bad_request,
    error_body,
    http_error,
)
from loraserve.gateway.http.logprobs import LogprobFormat
from loraserve.gateway.http.operations import OPEN_PATHS, AdapterRoutes, OperationRoutes
from loraserve.gateway.http.responses import Answers
from loraserve.gateway.http.responses_events import Reply
from loraserve.gateway.http.schemas import (
    INVALID_UNICODE,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)
from loraserve.gateway.http.structured import requested_constraint
from loraserve.gateway.http.tool_calling import ToolChoice, tool_choice
from loraserve.gateway.namespaces import Namespace
from loraserve.gateway.tenants import Scope
from loraserve.gateway.tool_parsers import ToolCallParser
from loraserve.structured import Constraint


def build_app(
    core: GenerationCore,
    admin: AdapterAdminService,
    chat_template: ChatTemplate | None,
    started_unix: int,
    tool_parser: ToolCallParser | None = None,
) -> FastAPI:
    """The ASGI app serving `core`'s generations and `admin`'s adapter loads over HTTP (no docs pages:
    the API is OpenAI's). A body without a Content-Type is read as JSON too. `tool_parser`: how the
    model writes tool calls (`tool_choice: auto`)."""
    routes = OpenAiRoutes(core, chat_template, started_unix, tool_parser)
    app = FastAPI(title="loraserve", docs_url=None, redoc_url=None, openapi_url=None, strict_content_type=False)
    app.state.core = core  # `Caller`'s
    operations, adapters = OperationRoutes(core, chat_template, routes.model), AdapterRoutes(admin)
    for method, path, endpoint in (
        ("GET", "/v1/models", routes.models),
        ("GET", "/v1/models/{model_id:path}", routes.model),
        ("POST", "/v1/completions", routes.completions),
        ("POST", "/v1/chat/completions", routes.chat_completions),
        ("POST", "/v1/responses", routes.responses),
        ("GET", "/health", operations.health),
        ("GET", "/version", operations.version),
        ("POST", "/tokenize", operations.tokenize),
        ("POST", "/detokenize", operations.detokenize),
        ("POST", "/v1/load_lora_adapter", adapters.load),
        ("POST", "/v1/unload_lora_adapter", adapters.unload),
    ):  # the answers are the handlers' own: no response model checks or re-encodes them
        app.add_api_route(path, endpoint, methods=[method], response_model=None)
    app.add_exception_handler(HttpError, _send_error)
    app.add_exception_handler(LoraserveError, _send_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    largest = 2 * core.limits.max_prompt_bytes + (1 << 16)  # the longest prompt, JSON-escaped, and the rest
    app.add_middleware(BodyGuard, authenticate=core.authenticate, max_body_bytes=largest, open_paths=OPEN_PATHS)
    return app


def _caller(request: Request) -> Principal:
    """The authenticated caller (a dependency of every route; `BodyGuard` has refused the others)."""
    return request.app.state.core.authenticate(http_metadata(request.headers))


Caller = Annotated[Principal, Depends(_caller)]  # every route's: the principal it acts for


class OpenAiRoutes:
    def __init__(
        self,
        core: GenerationCore,
        chat_template: ChatTemplate | None,
        started_unix: int,
        tool_parser: ToolCallParser | None = None,
    ):
        self.core, self.chat_template, self.started_unix = core, chat_template, started_unix
        self.tool_parser = tool_parser
        self.base_model = core.config.model_name

    # ---- models ---------------------------------------------------------------------------------
    async def models(self, principal: Caller) -> dict[str, Any]:
        return {"object": "list", "data": await self._models(principal)}

    async def model(self, model_id: str, principal: Caller) -> dict[str, Any]:
        found = next((m for m in await self._models(principal) if m["id"] == model_id), None)
        if found is None:
            raise AdapterNotFoundError(model_id)
        return found

    async def _models(self, principal: Principal) -> list[dict[str, Any]]:
        principal.require(Scope.GENERATE, "list models")
        listing = await self.core.adapters.list(Namespace.of(principal))
        longest = self.core.limits.max_context
        base = _card(self.base_model, self.started_unix, "loraserve", longest)
        adapters = [
            _card(a.name, int(a.created_unix), a.owner or "loraserve", longest, self.base_model)
            for a in listing.adapters
        ]
        return [base, *(a for a in adapters if a["id"] != self.base_model)]

    # ---- generation -----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request, principal: Caller) -> Response:
        answer_id, draft, drafts = f"cmpl-{uuid.uuid4().hex}", self._draft(body), []
        for index, prompt in enumerate(body.prompt_values()):
            given = {"prompt_text": prompt} if isinstance(prompt, str) else {"prompt_ids": list(prompt)}
            drafts += _choices(draft | given, body, f"{answer_id}-{index}")
        texts = [  # the prompts given as ids, decoded in a tokenizer thread
            p if isinstance(p, str) else await self.core.tokenizing.decode(p, not body.keep_special_tokens)
            for p in (body.prompt_values() if body.echo else ())
        ]
        echo = [t for t in texts for _ in range(body.choices)] if body.echo else None
        answers = Answers(answer_id, body, self._logprobs(body.logprobs is not None, body), echo)
        return await answer(self.core, drafts, answers, request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request, principal: Caller) -> Response:
        draft, tools = await self._chat(body, self._template("messages"), CHAT_PARAMS)
        answers = Answers(f"chatcmpl-{uuid.uuid4().hex}", body, self._logprobs(bool(body.logprobs), body), tools=tools)
        return await answer(self.core, _choices(draft, body, answers.id), answers, request)

    async def responses(self, body: ResponsesRequest, request: Request, principal: Caller) -> Response:
        """OpenAI's Responses API, served as the chat completion it asks for (`responses_api.py`); every
        failure names the Responses API's parameters."""
        template = self._template("input")
        refused = body.unsupported()
        if refused is not None:
            raise bad_request(*refused)
        chat = responses_api.chat_request(body)
        draft, tools = await self._chat(chat, template, RESPONSES_PARAMS, body.max_tool_calls)
        return await answer(self.core, [draft], Reply(f"resp_{uuid.uuid4().hex}", body, tools), request)

    def _template(self, param: str) -> ChatTemplate:
        """The model's chat template; a 400 naming `param` when it has none."""
        if self.chat_template is None:
            raise bad_request(
                param,
                f"model {self.base_model!r} has no chat template (no chat_template in its tokenizer_config.json): "
                "use /v1/completions with a prompt",
            )
        return self.chat_template

    async def _chat(
        self, chat: ChatCompletionRequest, template: ChatTemplate, params: dict[str, str], max_calls: int | None = None
    ) -> tuple[Fields, ToolChoice | None]:
        """A chat request's draft, with its prompt, and its use of its tools (`tool_calling.tool_choice`;
        `max_calls`: the Responses API's). The prompt is the conversation rendered by the chat template (the
        tools listed for it), as token ids, both in the tokenizer's threads; a problem with it is a 400
        naming the API's (`params`) parameter for the messages. With no max tokens asked for, the answer
        may run to the end of the context (as OpenAI and vLLM do)."""
        try:
            tools = tool_choice(chat.tools, chat.tool_choice, chat.parallel_tool_calls, self.tool_parser, max_calls)
        except LoraserveError as e:
            raise http_error(e) from None
        draft, limits = self._draft(chat, tools, params), self.core.limits
        try:
            listed = None if chat.tools is None else [t.model_dump(exclude_none=True) for t in chat.tools]
            text = await self.core.tokenizing.render(template, chat.conversation(), listed)
            if len(text.encode()) > limits.max_prompt_bytes:
                raise InvalidRequestError("messages", f"are longer than {limits.max_prompt_bytes} bytes")
            ids = await self.core.tokenizing.encode(text, "messages", add_special_tokens=False)
        except LoraserveError as e:
            raise http_error(e, params) from None
        sampling = draft["sampling"]
        if not sampling["max_new_tokens"]:
            sampling = sampling | {"max_new_tokens": max(1, limits.max_context - len(ids))}
        return {**draft, "prompt_ids": list(ids), "sampling": sampling}, tools

    def _logprobs(self, asked: bool, body: CompletionRequest | ChatCompletionRequest) -> LogprobFormat | None:
        chat = isinstance(body, ChatCompletionRequest)
        return LogprobFormat(self.core.tokenizer, chat, body.keep_special_tokens) if asked else None

    def _draft(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        tools: ToolChoice | None = None,
        params: dict[str, str] = PARAMS,
    ) -> Fields:
        """The request's generation (no prompt yet). `tools`: its tool choice, whose structured output the
        body may not ask for a constraint of its own beside; a problem with either names the API's
        parameter (`params`). The constraint stays uncompiled: the generation core compiles it after
        validation, in the gateway's sandbox."""
        refused = body.unsupported()
        if refused is not None:
            raise bad_request(*refused)
        try:
            constraint = _one_constraint(requested_constraint(body.constraint_fields()), tools)
        except LoraserveError as e:
            raise http_error(e, params) from None
        adapter = "" if body.model == self.base_model else body.model  # "": the base model
        return body.generation_fields() | {"adapter": adapter, "constraint": constraint}


def _one_constraint(constraint: Constraint | None, tools: ToolChoice | None) -> Constraint | None:
    """The request's one output constraint: its own, or the one its tool choice needs; a 400 when it asks
    for both (one grammar per request)."""
    tool_constraint = None if tools is None else tools.constraint()
    if constraint is not None and tool_constraint is not None:
        raise InvalidRequestError(
            constraint.field,
            "cannot be combined with tool_choice 'required', a named function, or 'auto' with strict tools",
        )
    return constraint or tool_constraint


def _choices(draft: Fields, body: CompletionRequest | ChatCompletionRequest, group: str) -> list[Fields]:
    """One prompt's generations: `body.candidates` of them (n, or best_of), one prefill group, so the
    prompt is computed once. With a seed, candidate i draws with seed + i (the first with the seed
    itself, as a single choice would); without, each draws its own. best_of > n ranks the candidates
    by their log-probability, so they report it even when the answer does not show it."""
    if body.candidates == 1:
        return [draft]
    drafts = []
    for i in range(body.candidates):
        sampling = dict(draft["sampling"])
        if "seed" in sampling:
            sampling["seed"] = (sampling["seed"] + i) % 2**63
        if body.candidates > body.choices:
            sampling.setdefault("logprobs", 0)
        drafts.append({**draft, "prefill_group": group, "sampling": sampling})
    return drafts


def _card(model_id: str, created: int, owner: str, max_model_len: int, parent: str | None = None) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": owner,
        "root": model_id,
        "parent": parent,
        "max_model_len": max_model_len,
    }


async def _send_error(_request: Request, error: HttpError | LoraserveError) -> JSONResponse:
    error = error if isinstance(error, HttpError) else http_error(error)
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's complaint as a 400 naming the parameter (FastAPI's default is a 422 of its own shape)."""
    problem = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in problem.get("loc", ()) if part != "body"]
    if problem.get("type") == INVALID_UNICODE:
        error = bad_request(problem["ctx"]["param"], problem["msg"])
    elif problem.get("type") == "json_invalid" or not location:
        why = "send a JSON object with Content-Type: application/json"
        error = bad_request("body", f"{problem.get('msg', 'is not valid')}: {why}")
    else:
        error = bad_request(location[0], f"{problem.get('msg', 'is invalid')} (at {'.'.join(location)})")
    return await _send_error(request, error)


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)
