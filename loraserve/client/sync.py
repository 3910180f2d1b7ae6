"""The blocking client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, Unpack

import grpc

from loraserve.client import api
from loraserve.client.api import AdapterInfo, Chunk, GenerateOptions, Generation, ModelInfo, Prompt, Tokens
from loraserve.client.retry import DEFAULT_DEADLINES, DEFAULT_RETRY, Deadlines, RetryPolicy, Settings
from loraserve.v1 import gateway_pb2_grpc

R = TypeVar("R")


class Client:
    """A blocking client of `loraserve.v1.LoraServe`; safe to share between threads.

    `api_key` is sent as `authorization: Bearer <key>`. TLS is used when `tls` is true or any of
    `root_certificates` / `private_key` / `certificate_chain` (PEM bytes, as `grpc.ssl_channel_credentials`
    takes them) is given. Each call takes `timeout` (seconds, for all its tries; default from
    `deadlines`) and raises `ApiError`. Safe calls failing with UNAVAILABLE are retried per `retry`.
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
        sleep: Callable[[float], None] = time.sleep,
    ):
        credentials = api.channel_credentials(tls, root_certificates, private_key, certificate_chain)
        self._channel = api.open_channel(grpc, address, credentials, channel_options)
        self._stub = gateway_pb2_grpc.LoraServeStub(self._channel)
        self._settings = Settings(api.auth_metadata(api_key), deadlines, retry)
        self._sleep = sleep

    def generate(
        self, prompt: Prompt, adapter: str = "", *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Generation:
        """Generate a whole completion; `adapter` "" is the base model, `prompt` text or token ids."""
        return self._unary(api.generate(prompt, adapter, options), timeout)

    def stream(
        self, prompt: Prompt, adapter: str = "", *, timeout: float | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[Chunk | Generation]:
        """Yield `Chunk`s as they are generated, then the `Generation` with the whole text.

        Retried only before its first event: a stream that yielded something raises on failure.
        """
        call = api.stream(prompt, adapter, options)
        attempts = self._settings.attempts(call, timeout)
        while True:
            assembler = api.StreamAssembler()
            events = self._stub.GenerateStream(
                call.request, timeout=attempts.timeout_s(), metadata=self._settings.metadata
            )
            try:
                for event in events:
                    yield assembler.add(event)
                return
            except grpc.RpcError as e:
                self._sleep(attempts.after(e, started=assembler.started))
            finally:
                events.cancel()  # the caller stopped early: end the request on the server too

    def tokenize(self, text: str, add_special_tokens: bool = False, *, timeout: float | None = None) -> Tokens:
        return self._unary(api.tokenize(text, add_special_tokens), timeout)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False, *, timeout: float | None = None) -> str:
        return self._unary(api.detokenize(ids, skip_special_tokens), timeout)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return self._unary(api.model_info(), timeout)

    def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        return self._unary(api.list_adapters(), timeout)

    def describe_adapter(self, name: str, *, timeout: float | None = None) -> AdapterInfo:
        return self._unary(api.describe_adapter(name), timeout)

    def upload_adapter(self, name: str, directory: str | Path, *, timeout: float | None = None) -> AdapterInfo:
        """Register the PEFT adapter in `directory` as `name` (never retried)."""
        return self._unary(api.upload_adapter(name, Path(directory)), timeout)

    def delete_adapter(self, name: str, *, timeout: float | None = None) -> int:
        """Delete `name`; returns the version that was current (never retried)."""
        return self._unary(api.delete_adapter(name), timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, call: api.Call[R], timeout: float | None) -> R:
        attempts = self._settings.attempts(call, timeout)
        method = getattr(self._stub, call.method)
        while True:
            try:
                return call.parse(method(call.request, timeout=attempts.timeout_s(), metadata=self._settings.metadata))
            except grpc.RpcError as e:
                self._sleep(attempts.after(e))
