"""The gRPC RPCs about the model: `Tokenize`, `Detokenize` and `GetModelInfo` (scope `generate`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import grpc

from loraserve.errors import InvalidRequestError
from loraserve.gateway.core import GenerationCore
from loraserve.gateway.grpc_calls import metadata_of
from loraserve.gateway.tenants import Scope
from loraserve.v1 import gateway_pb2


class ModelService:
    """The base model's tokenizer and description, for an authenticated caller."""

    def __init__(self, core: GenerationCore):
        self.core = core

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        self._require(context, "tokenize")
        limit = self.core.limits.max_prompt_bytes
        if len(request.text.encode()) > limit:
            raise InvalidRequestError("text", f"is longer than {limit} bytes")
        ids = self.core.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        return gateway_pb2.TokenizeResponse(ids=ids, tokens=self.core.tokenizer.token_strings(ids))

    async def Detokenize(self, request: gateway_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        self._require(context, "detokenize")
        vocab = self.core.limits.vocab_size
        bad = next((i for i, t in enumerate(request.ids) if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                "ids", f"ids[{bad}] = {request.ids[bad]} is not below the vocabulary size {vocab}"
            )
        text = self.core.tokenizer.decode(list(request.ids), skip_special_tokens=request.skip_special_tokens)
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


def package_version() -> str:
    """The installed loraserve release; "unknown" when run from a source tree never installed."""
    try:
        return version("loraserve")
    except PackageNotFoundError:
        return "unknown"
