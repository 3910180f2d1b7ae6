"""The gRPC RPCs about the model: `Tokenize`, `Detokenize` and `GetModelInfo` (scope `generate`).

`Tokenize` and `Detokenize` are metered as generations are (`metered.py`: a tenant slot, the request
counter) and run in the tokenizer's threads (`tokenizing.py`), never on the event loop; a text too
long to fit the context is refused before it is tokenized.
"""

from __future__ import annotations

from collections.abc import Awaitable
from importlib.metadata import PackageNotFoundError, version
from typing import TypeVar

import grpc

from loraserve.errors import InvalidRequestError
from loraserve.gateway.core import GenerationCore
from loraserve.gateway.events import RetryLaterError
from loraserve.gateway.grpc_calls import metadata_of
from loraserve.gateway.metered import metered
from loraserve.gateway.tenants import Scope
from loraserve.grpc_utils import RETRY_AFTER_KEY
from loraserve.v1 import gateway_pb2

T = TypeVar("T")


class ModelService:
    """The base model's tokenizer and description, for an authenticated caller."""

    def __init__(self, core: GenerationCore):
        self.core = core

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        return await _hinted(context, self._tokenize(request, metadata_of(context)))

    async def Detokenize(self, request: gateway_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        return await _hinted(context, self._detokenize(request, metadata_of(context)))

    async def _tokenize(self, request: gateway_pb2.TokenizeRequest, metadata: dict[str, str]):
        async with metered(self.core, metadata, "tokenize"):
            limit = self.core.limits.max_prompt_bytes
            if len(request.text) > limit or len(request.text.encode()) > limit:
                raise InvalidRequestError("text", f"is longer than {limit} bytes")
            ids, tokens = await self.core.tokenizing.encode_with_strings(
                request.text, "text", add_special_tokens=request.add_special_tokens
            )
            return gateway_pb2.TokenizeResponse(ids=ids, tokens=tokens)

    async def _detokenize(self, request: gateway_pb2.DetokenizeRequest, metadata: dict[str, str]):
        async with metered(self.core, metadata, "detokenize"):
            vocab = self.core.limits.vocab_size
            bad = next((i for i, t in enumerate(request.ids) if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    "ids", f"ids[{bad}] = {request.ids[bad]} is not below the vocabulary size {vocab}"
                )
            text = await self.core.tokenizing.decode(request.ids, skip_special_tokens=request.skip_special_tokens)
            return gateway_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        self._require(context, "read model info")
        core = self.core
        return gateway_pb2.ModelInfo(
            model_type=core.config.model_type,
            model_name=core.config.model_name,
            vocab_size=core.limits.vocab_size,
            max_context_length=core.limits.max_context,
            default_max_new_tokens=core.limits.default_max_new_tokens,
            max_lora_rank=core.config.max_lora_rank,
            ready_workers=core.ready_workers,
            eos_token_ids=list(core.tokenizer.eos_token_ids),
            server_version=package_version(),
        )

    def _require(self, context: grpc.aio.ServicerContext, action: str) -> None:
        self.core.authenticate(metadata_of(context)).require(Scope.GENERATE, action)


async def _hinted(context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
    """`work`'s result; a refusal with a retry hint (a slot, a busy tokenizer) sends it as `retry-after-ms`."""
    try:
        return await work
    except RetryLaterError as e:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(e.retry_after_ms)),))
        raise


def package_version() -> str:
    """The installed loraserve release; "unknown" when run from a source tree never installed."""
    try:
        return version("loraserve")
    except PackageNotFoundError:
        return "unknown"
