"""The HTTP port's operational routes, in vLLM's shapes (the README lists their bodies and answers):
`/health`, `/version`, `/tokenize`, `/detokenize`, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

`/health` and `/version` need no key (probes carry none). `/tokenize` and `/detokenize` are metered as the
gRPC `Tokenize` and `Detokenize` are (`gateway/metered.py`) and use the base model's tokenizer, in its
threads (`gateway/tokenizing.py`). The adapter routes are the gRPC `RegisterAdapterFromPath` and
`DeleteAdapter`, run by the same adapter admin (`gateway/admin_service.py`); their failures name
`lora_name` or `lora_path`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from loraserve.errors import InvalidRequestError, LoraserveError
from loraserve.gateway.admin_service import AdapterAdminService
from loraserve.gateway.auth import Principal
from loraserve.gateway.chat_template import ChatTemplate
from loraserve.gateway.core import GenerationCore
from loraserve.gateway.http.answering import http_metadata
from loraserve.gateway.http.errors import HttpError, bad_request, error_body, http_error
from loraserve.gateway.http.schemas import (
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    conversation,
)
from loraserve.gateway.metered import metered
from loraserve.gateway.model_service import package_version
from loraserve.v1 import gateway_pb2

OPEN_PATHS = frozenset({"/health", "/version"})  # answered without a key
ADAPTER_PARAMS = {"name": "lora_name", "path": "lora_path"}  # the gRPC request's fields, as these routes name them

FindModel = Callable[[str, Principal], Awaitable[Any]]  # raises AdapterNotFoundError for a model the caller lacks


class OperationRoutes:
    def __init__(self, core: GenerationCore, chat_template: ChatTemplate | None, find_model: FindModel):
        self.core, self.chat_template, self.find_model = core, chat_template, find_model

    async def health(self) -> Response:
        if self.core.gate.draining:
            return _unavailable("this gateway is shutting down")
        if self.core.ready_workers < 1:
            return _unavailable("no worker is ready")
        return Response(status_code=200)

    async def version(self) -> dict[str, str]:
        return {"version": package_version()}

    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict[str, Any]:
        async with metered(self.core, http_metadata(request.headers), "tokenize") as principal:
            if body.model is not None:  # one the caller can use
                await self.find_model(body.model, principal)
            if (body.prompt is None) == (body.messages is None):
                raise InvalidRequestError("prompt", "give either a prompt or messages")
            tokenizing = self.core.tokenizing
            if body.prompt is not None:
                field, text = "prompt", body.prompt
                special = True if body.add_special_tokens is None else body.add_special_tokens
            else:
                if self.chat_template is None:
                    raise InvalidRequestError("messages", "the model has no chat template: tokenize a prompt")
                field, special = "messages", bool(body.add_special_tokens)
                text = await tokenizing.render(self.chat_template, conversation(body.messages))
            limit = self.core.limits.max_prompt_bytes
            if len(text) > limit or len(text.encode()) > limit:
                raise InvalidRequestError(field, f"is longer than {limit} bytes")
            if body.return_token_strs:
                ids, strings = await tokenizing.encode_with_strings(text, field, add_special_tokens=special)
            else:
                ids, strings = await tokenizing.encode(text, field, add_special_tokens=special), None
        return {"count": len(ids), "max_model_len": self.core.limits.max_context, "tokens": ids, "token_strs": strings}

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict[str, str]:
        async with metered(self.core, http_metadata(request.headers), "detokenize") as principal:
            if body.model is not None:
                await self.find_model(body.model, principal)
            vocab = self.core.limits.vocab_size
            bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    "tokens", f"tokens[{bad}] = {body.tokens[bad]} is not below the vocabulary size {vocab}"
                )
            return {"prompt": await self.core.tokenizing.decode(body.tokens, skip_special_tokens=False)}


def _unavailable(why: str) -> JSONResponse:
    return JSONResponse(error_body(why, "service_unavailable_error", code="unavailable"), status_code=503)


class AdapterRoutes:
    def __init__(self, admin: AdapterAdminService):
        self.admin = admin

    async def load(self, body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        call = gateway_pb2.RegisterAdapterFromPathRequest(name=body.lora_name, path=body.lora_path)
        try:
            await self.admin.register(http_metadata(request.headers), call)
        except LoraserveError as e:
            raise _named(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        if body.lora_int_id is not None:
            raise bad_request("lora_int_id", "adapters are named here: give lora_name alone")
        try:
            await self.admin.delete(http_metadata(request.headers), body.lora_name)
        except LoraserveError as e:
            raise _named(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _named(e: LoraserveError) -> HttpError:
    """`e` as an HTTP failure whose `param` is this API's name for the field: the store's refusals come
    back over gRPC as messages that start with the field's name; a missing adapter names the model
    (here: lora_name)."""
    error = http_error(e)
    body = error.body["error"]
    first_word = re.match(r"\w*", body["message"]).group()  # "path: ...", "path '...': no such directory"
    if first_word in ADAPTER_PARAMS:
        body["param"] = ADAPTER_PARAMS[first_word]
    elif error.status == 413:  # the adapter at the path is over the store's --max-adapter-mb
        body["param"] = "lora_path"
    elif body["param"] in ("model", "name"):
        body["param"] = "lora_name"
    return error
