"""The asyncio client: the same calls as `Client`, sent on a `grpc.aio` channel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, Unpack

import grpc

from loraserve.client import api
from loraserve.client.api import AdapterInfo, Chunk, GenerateOptions, Generation, ModelInfo, Prompt, Tokens
from loraserve.client.retry import DEFAULT_DEADLINES, DEFAULT_RETRY, Deadlines, RetryPolicy, Settings
from loraserve.v1 import gateway_pb2_grpc

R = TypeVar("R")


class AsyncClient:
    """An asyncio client of `loraserve.v1.LoraServe`, with `Client`'s options, calls and retries.

    Create it inside the event loop that uses it (`async with AsyncClient(address) as client:`).
    """

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        deadlines: Deadlines = DEFAULT_DEADLINES,
        channel_options: Sequence[tuple[str, Any]] = (),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        credentials = api.channel_credentials(tls, root_certificates, private_key, certificate_chain)
        self._channel = api.open_channel(grpc.aio, address, credentials, channel_options)
        self._stub = gateway_pb2_grpc.LoraServeStub(self._channel)
        self._settings = Settings(api.auth_metadata(api_key), deadlines, retry)
        self._sleep = sleep

    async def generate(
        self, prompt: Prompt, adapter: str = "", *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Generation:
        """Generate a whole completion; `adapter` "" is the base model, `prompt` text or token ids."""
        return await self._unary(api.generate(prompt, adapter, options), timeout)

    async def stream(
        self, prompt: Prompt, adapter: str = "", *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncIterator[Chunk | Generation]:
        """Yield `Chunk`s as they are generated, then the `Generation` (retried only before its first event)."""
        call = api.stream(prompt, adapter, options)
        attempts = self._settings.attempts(call, timeout)
        while True:
            assembler = api.StreamAssembler()
            events = self._stub.GenerateStream(
                call.request, timeout=attempts.timeout_s(), metadata=self._settings.metadata
            )
            try:
                async for event in events:
                    yield assembler.add(event)
                return
            except grpc.RpcError as e:
                await self._sleep(attempts.after(e, started=assembler.started))
            finally:
                events.cancel()

    async def tokenize(self, text: str, add_special_tokens: bool = False, *, timeout: float | None = None) -> Tokens:
        return await self._unary(api.tokenize(text, add_special_tokens), timeout)

    async def detokenize(
        self, ids: Sequence[int], skip_special_tokens: bool = False, *, timeout: float | None = None
    ) -> str:
        return await self._unary(api.detokenize(ids, skip_special_tokens), timeout)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return await self._unary(api.model_info(), timeout)

    async def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        return await self._unary(api.list_adapters(), timeout)

    async def describe_adapter(self, name: str, *, timeout: float | None = None) -> AdapterInfo:
        return await self._unary(api.describe_adapter(name), timeout)

    async def upload_adapter(self, name: str, directory: str | Path, *, timeout: float | None = None) -> AdapterInfo:
        """Register the PEFT adapter in `directory` as `name` (never retried)."""
        return await self._unary(api.upload_adapter(name, Path(directory)), timeout)

    async def delete_adapter(self, name: str, *, timeout: float | None = None) -> int:
        """Delete `name`; returns the version that was current (never retried)."""
        return await self._unary(api.delete_adapter(name), timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, call: api.Call[R], timeout: float | None) -> R:
        attempts = self._settings.attempts(call, timeout)
        method = getattr(self._stub, call.method)
        while True:
            try:
                reply = await method(call.request, timeout=attempts.timeout_s(), metadata=self._settings.metadata)
                return call.parse(reply)
            except grpc.RpcError as e:
                await self._sleep(attempts.after(e))
