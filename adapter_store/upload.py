"""Assembling a streamed upload (header, then file chunks), refusing bad streams as they arrive.

A plain object fed one message at a time by the gRPC handler, so a stream that is wrong (a chunk
before the header, a second header, an unknown file, a file over its limit) fails at that message,
before the rest is received. Chunks of different files may interleave; chunks of one file arrive
in order and are joined once at the end (one copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.adapter_config import CONFIG_FILE
from loraserve.adapter_format import BIN_FILE, SAFETENSORS_FILE, WEIGHTS_FILES
from loraserve.adapter_store.config import MAX_CONFIG_BYTES, MIB
from loraserve.adapter_store.files import too_large_message
from loraserve.adapter_store.validation import check_name
from loraserve.errors import InvalidRequestError, TooLargeError

MAX_CHUNK_BYTES = 4 * MIB  # as the proto documents


@dataclass(frozen=True)
class Upload:
    name: str
    config_json: bytes
    weights: bytes
    weights_format: str


@dataclass
class UploadAssembler:
    max_weights_bytes: int
    name: str | None = None
    _parts: dict[str, list[bytes]] = field(default_factory=dict)
    _sizes: dict[str, int] = field(default_factory=dict)

    def header(self, name: str) -> None:
        if self.name is not None:
            raise InvalidRequestError("header", "sent twice; an upload has exactly one header, as its first message")
        check_name(name, field="header.name")
        self.name = name

    def chunk(self, file: str, data: bytes) -> None:
        if self.name is None:
            raise InvalidRequestError("header", "missing: the first message of an upload must be the header")
        if file != CONFIG_FILE and file not in WEIGHTS_FILES:
            raise InvalidRequestError(
                "chunk.file", f"unknown file {file[:100]!r}; expected {CONFIG_FILE}, {SAFETENSORS_FILE} or {BIN_FILE}"
            )
        if len(data) > MAX_CHUNK_BYTES:
            raise InvalidRequestError("chunk.data", f"{len(data)} bytes; a chunk may hold at most {MAX_CHUNK_BYTES}")
        weights = [f for f in self._parts if f in WEIGHTS_FILES]
        if file in WEIGHTS_FILES and weights and weights[0] != file:
            raise InvalidRequestError("chunk.file", f"send either {SAFETENSORS_FILE} or {BIN_FILE}, not both")
        size = self._sizes.get(file, 0) + len(data)
        if file == CONFIG_FILE and size > MAX_CONFIG_BYTES:
            raise InvalidRequestError(CONFIG_FILE, f"larger than {MAX_CONFIG_BYTES} bytes; an adapter config is small")
        if file in WEIGHTS_FILES and size > self.max_weights_bytes:
            raise TooLargeError(too_large_message(size, self.max_weights_bytes) + " (upload refused)")
        self._parts.setdefault(file, []).append(data)
        self._sizes[file] = size

    @property
    def weights_bytes(self) -> int:
        return sum(size for file, size in self._sizes.items() if file in WEIGHTS_FILES)

    def finish(self) -> Upload:
        if self.name is None:
            raise InvalidRequestError("header", "missing: the upload stream was empty")
        if CONFIG_FILE not in self._parts:
            raise InvalidRequestError(CONFIG_FILE, "missing: the upload ended without it")
        weights_file = next((f for f in self._parts if f in WEIGHTS_FILES), None)
        if weights_file is None:
            raise InvalidRequestError(SAFETENSORS_FILE, f"missing: the upload ended without it (or {BIN_FILE})")
        return Upload(
            name=self.name,
            config_json=b"".join(self._parts[CONFIG_FILE]),
            weights=b"".join(self._parts[weights_file]),
            weights_format=WEIGHTS_FILES[weights_file],
        )
