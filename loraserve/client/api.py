"""What the sync and asyncio clients share: the typed results, the one error class, and each call as data.

A `Call` is a request message plus how to read its reply, which deadline applies and whether it is safe
to repeat; `Client` and `AsyncClient` only send it. Protobuf stays at this edge: callers get frozen
dataclasses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypedDict, TypeVar

import grpc

from loraserve.v1 import common_pb2, gateway_pb2

R = TypeVar("R")
Kind = Literal["generate", "stream", "query", "upload", "delete"]
CHUNK_BYTES = 1 << 20  # upload chunk size; the API accepts at most 4 MiB per chunk
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
Prompt = str | Sequence[int]  # text, or token ids used as given


class ApiError(Exception):
    """A failed call: `code` is the gRPC status name (NOT_FOUND, INVALID_ARGUMENT, UNAVAILABLE, ...),
    `details` the server's message (for INVALID_ARGUMENT it names the field)."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> ApiError:
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        return cls(code.name, details or "")


def _from_pb(cls: type[R], message: Any) -> R:
    """`cls` (a dataclass whose fields are named as the message's) filled from `message`."""
    values = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(message, field.name)
        values[field.name] = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
    return cls(**values)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Timings:
    """Where a request's latency went, in seconds (zero where a phase did not happen)."""

    queue_s: float
    adapter_load_s: float
    prefill_s: float
    time_to_first_token_s: float
    decode_s: float
    total_s: float


@dataclass(frozen=True)
class Generation:
    """A finished generation. `finish_reason`: "stop" (EOS or a stop token), "length", "stop_sequence"."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    timings: Timings
    adapter_version: int  # 0 for the base model
    failovers: int  # times it lost its worker and continued on another
    worker_id: str
    request_id: str
    client_request_id: str

    @classmethod
    def from_pb(cls, pb: gateway_pb2.GenerateResponse, text: str, token_ids: Sequence[int]) -> Generation:
        reason = common_pb2.FinishReason.Name(pb.finish_reason).removeprefix("FINISH_REASON_").lower()
        return cls(
            text=text,
            token_ids=tuple(token_ids),
            finish_reason=reason,
            usage=_from_pb(Usage, pb.usage),
            timings=_from_pb(Timings, pb.timings),
            adapter_version=pb.adapter_version,
            failovers=pb.failovers,
            worker_id=pb.worker_id,
            request_id=pb.request_id,
            client_request_id=pb.client_request_id,
        )


@dataclass(frozen=True)
class Chunk:
    """Text and token ids a stream produced since its previous chunk (text may lag behind the ids)."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Tokens:
    ids: tuple[int, ...]
    tokens: tuple[str, ...]


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    model_name: str
    vocab_size: int
    max_context_length: int
    default_max_new_tokens: int
    max_lora_rank: int
    ready_workers: int
    eos_token_ids: tuple[int, ...]
    server_version: str


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    version: int
    rank: int
    lora_alpha: float
    scale: float
    target_modules: tuple[str, ...]
    layers: tuple[int, ...]
    size_bytes: int
    created_unix: float
    source: str
    sha256: str
    owner: str  # empty for a public adapter


class GenerateOptions(TypedDict, total=False):
    """Keyword options of `generate` and `stream` (see GenerateRequest and SamplingParameters)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    ignore_eos: bool
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    client_request_id: str


_SAMPLING = frozenset(common_pb2.SamplingParameters.DESCRIPTOR.fields_by_name)


@dataclass(frozen=True)
class Call(Generic[R]):
    """One RPC, ready to send: `idempotent` calls may be retried on UNAVAILABLE."""

    method: str  # the LoraServe RPC
    request: Any  # its request message (an iterator of them for UploadAdapter)
    parse: Callable[[Any], R]
    kind: Kind  # which default deadline applies
    idempotent: bool


def generate_request(prompt: Prompt, adapter: str, options: Mapping[str, Any]) -> gateway_pb2.GenerateRequest:
    unknown = set(options) - GenerateOptions.__optional_keys__
    if unknown:
        raise TypeError(f"unknown generate options: {', '.join(sorted(unknown))}")
    sampling = common_pb2.SamplingParameters(**{k: v for k, v in options.items() if k in _SAMPLING})
    rest = {k: v for k, v in options.items() if k not in _SAMPLING}
    if isinstance(prompt, str):
        return gateway_pb2.GenerateRequest(adapter=adapter, text=prompt, sampling=sampling, **rest)
    ids = gateway_pb2.TokenIds(ids=list(prompt))
    return gateway_pb2.GenerateRequest(adapter=adapter, token_ids=ids, sampling=sampling, **rest)


def generate(prompt: Prompt, adapter: str, options: Mapping[str, Any]) -> Call[Generation]:
    request = generate_request(prompt, adapter, options)
    return Call("Generate", request, lambda pb: Generation.from_pb(pb, pb.text, pb.token_ids), "generate", True)


def stream(prompt: Prompt, adapter: str, options: Mapping[str, Any]) -> Call[None]:
    """GenerateStream: its events go through a `StreamAssembler` (no `parse`), and it is retried only
    while none arrived (`StreamAssembler.started`)."""
    return Call("GenerateStream", generate_request(prompt, adapter, options), lambda _: None, "stream", True)


def tokenize(text: str, add_special_tokens: bool) -> Call[Tokens]:
    request = gateway_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
    return Call("Tokenize", request, lambda pb: _from_pb(Tokens, pb), "query", True)


def detokenize(ids: Sequence[int], skip_special_tokens: bool) -> Call[str]:
    request = gateway_pb2.DetokenizeRequest(ids=list(ids), skip_special_tokens=skip_special_tokens)
    return Call("Detokenize", request, lambda pb: pb.text, "query", True)


def model_info() -> Call[ModelInfo]:
    return Call("GetModelInfo", gateway_pb2.GetModelInfoRequest(), lambda pb: _from_pb(ModelInfo, pb), "query", True)


def list_adapters() -> Call[list[AdapterInfo]]:
    request = gateway_pb2.ListAdaptersRequest()
    return Call("ListAdapters", request, lambda pb: [_from_pb(AdapterInfo, a) for a in pb.adapters], "query", True)


def describe_adapter(name: str) -> Call[AdapterInfo]:
    request = gateway_pb2.DescribeAdapterRequest(name=name)
    return Call("DescribeAdapter", request, lambda pb: _from_pb(AdapterInfo, pb), "query", True)


def delete_adapter(name: str) -> Call[int]:
    request = gateway_pb2.DeleteAdapterRequest(name=name)
    return Call("DeleteAdapter", request, lambda pb: pb.version, "delete", False)


def upload_adapter(name: str, directory: Path, chunk_bytes: int = CHUNK_BYTES) -> Call[AdapterInfo]:
    """UploadAdapter from a PEFT directory: adapter_config.json and its weights file, in chunks."""
    directory = Path(directory)
    config = directory / "adapter_config.json"
    weights = next((directory / f for f in WEIGHT_FILES if (directory / f).is_file()), None)
    if not config.is_file() or weights is None:
        raise FileNotFoundError(f"{directory} needs adapter_config.json and one of {', '.join(WEIGHT_FILES)}")
    requests = _upload_requests(name, [config, weights], chunk_bytes)
    return Call("UploadAdapter", requests, lambda pb: _from_pb(AdapterInfo, pb), "upload", False)


def _upload_requests(name: str, files: list[Path], chunk_bytes: int) -> Iterator[gateway_pb2.UploadAdapterRequest]:
    yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name=name))
    for path in files:
        with path.open("rb") as f:
            while data := f.read(chunk_bytes):
                yield gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file=path.name, data=data))


class StreamAssembler:
    """Turns GenerateStream events into `Chunk`s, then a `Generation` holding the whole text and token ids."""

    def __init__(self) -> None:
        self.started = False  # an event arrived: the request ran, so it must not be retried silently
        self._text: list[str] = []
        self._token_ids: list[int] = []

    def add(self, event: gateway_pb2.GenerateStreamResponse) -> Chunk | Generation:
        self.started = True
        if event.HasField("chunk"):
            self._text.append(event.chunk.text)
            self._token_ids += event.chunk.token_ids
            return Chunk(event.chunk.text, tuple(event.chunk.token_ids))
        return Generation.from_pb(event.summary, "".join(self._text), self._token_ids)


def channel_credentials(
    tls: bool | None,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel. `tls=None`: TLS when any certificate is given."""
    if tls is None:
        tls = any(v is not None for v in (root_certificates, private_key, certificate_chain))
    if not tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def open_channel(
    grpc_module: Any,
    address: str,
    credentials: grpc.ChannelCredentials | None,
    channel_options: Sequence[tuple[str, Any]],
) -> Any:
    """A channel from `grpc` or `grpc.aio` (the same two calls in both), TLS when given credentials."""
    options = list(channel_options)
    if credentials is None:
        return grpc_module.insecure_channel(address, options)
    return grpc_module.secure_channel(address, credentials, options)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
