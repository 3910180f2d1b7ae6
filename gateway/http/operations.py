"""The HTTP port's operational routes, in vLLM's shapes: `/health`, `/version`, `/tokenize`, `/detokenize`.

`/health` and `/version` need no key (probes and load balancers carry none, as gRPC health needs
none): `/health` answers 200 with an empty body while at least one worker is ready and the gateway
is not draining, else 503 with an OpenAI error body saying which. `/tokenize` and `/detokenize` act
for an authenticated caller (scope `generate`, as the gRPC `Tokenize` and `Detokenize`) and use the
base model's tokenizer, which every adapter shares; a `model` they are given must be one the caller
can use. Over gRPC the version is `ModelInfo.server_version`, and `max_model_len` `max_context_length`.

    POST /tokenize    {"prompt": str} or {"messages": [...]}, "add_special_tokens", "return_token_strs"
                      -> {"count", "max_model_len", "tokens": [ids], "token_strs": [str] | null}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": str}
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loraserve.errors import InvalidRequestError, LoraserveError
from loraserve.gateway.auth import Principal
from loraserve.gateway.chat_template import ChatTemplate
from loraserve.gateway.core import GenerationCore
from loraserve.gateway.http.errors import bad_request, error_body, http_error
from loraserve.gateway.http.schemas import DetokenizeRequest, TokenizeRequest, conversation
from loraserve.gateway.model_service import package_version
from loraserve.gateway.tenants import Scope

OPEN_PATHS = frozenset({"/health", "/version"})  # answered without a key

FindModel = Callable[[str, Principal], Awaitable[Any]]  # raises a 404 HttpError for a model the caller lacks
Caller = Callable[[Request], Principal]  # the authenticated caller of a request


class OperationRoutes:
    def __init__(self, core: GenerationCore, chat_template: ChatTemplate | None, caller: Caller, find_model: FindModel):
        self.core, self.chat_template, self.caller, self.find_model = core, chat_template, caller, find_model

    async def health(self) -> Response:
        if self.core.admission.draining:
            return _unavailable("this gateway is shutting down")
        if self.core.ready_workers < 1:
            return _unavailable("no worker is ready")
        return Response(status_code=200)

    async def version(self) -> dict[str, str]:
        return {"version": package_version()}

    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict[str, Any]:
        await self._caller(request, body.model, "tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt", "give either a prompt or messages")
        limit = self.core.limits.max_prompt_bytes
        try:
            if body.prompt is not None:
                text, special = body.prompt, True if body.add_special_tokens is None else body.add_special_tokens
            else:
                if self.chat_template is None:
                    raise bad_request("messages", "the model has no chat template: tokenize a prompt")
                text, special = self.chat_template.render(conversation(body.messages)), bool(body.add_special_tokens)
            if len(text.encode()) > limit:
                raise InvalidRequestError("prompt", f"is longer than {limit} bytes")
        except LoraserveError as e:
            raise http_error(e, "prompt" if body.prompt is not None else "messages") from None
        ids = self.core.tokenizer.encode(text, add_special_tokens=special)
        return {
            "count": len(ids),
            "max_model_len": self.core.limits.max_context,
            "tokens": ids,
            "token_strs": self.core.tokenizer.token_strings(ids) if body.return_token_strs else None,
        }

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict[str, str]:
        await self._caller(request, body.model, "detokenize")
        vocab = self.core.limits.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            raise bad_request("tokens", f"tokens[{bad}] = {body.tokens[bad]} is not below the vocabulary size {vocab}")
        return {"prompt": self.core.tokenizer.decode(list(body.tokens), skip_special_tokens=False)}

    async def _caller(self, request: Request, model: str | None, action: str) -> Principal:
        principal = self.caller(request)
        principal.require(Scope.GENERATE, action)
        if model is not None:
            await self.find_model(model, principal)
        return principal


def _unavailable(why: str) -> JSONResponse:
    return JSONResponse(error_body(why, "service_unavailable_error", code="unavailable"), status_code=503)
