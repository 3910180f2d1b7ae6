"""One OpenAI-compatible streaming client for both systems: POST /v1/completions, stream=true, SSE.

Plain asyncio streams and HTTP/1.1 (one connection per request, `Connection: close`), so the two
systems get byte-for-byte the same client and no third-party HTTP stack sits in the timings. Each
request is greedy (temperature 0), `max_tokens` fixed and `ignore_eos` set (both servers take
vLLM's extension), with `stream_options.include_usage` so the last chunk counts the tokens. The
agreement check's requests (`check=True`) also ask for `logprobs: 0` (each chunk names its tokens'
texts) and `return_token_ids` (vLLM's extension: the ids; loraserve ignores it); the timed runs ask
for neither.

    results = asyncio.run(send_all("127.0.0.1", 8000, requests, concurrency=8, max_tokens=64))
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from loraserve.bench.suites.peer.plan import Request

TIMEOUT_S = 300.0  # one request, start to end


@dataclass
class Completion:
    """One streamed completion as the client saw it; times are `time.perf_counter()` seconds."""

    sent_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried a choice
    text: str = ""
    token_texts: list[str] = field(default_factory=list)  # with logprobs: each token's text
    token_ids: list[int] = field(default_factory=list)  # with return_token_ids, where the server sends them
    tokens: int | None = None  # the usage's completion_tokens (None: no usage chunk came)
    error: str | None = None
    done_s: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def itl_s(self) -> list[float]:
        """The gaps between consecutive chunks."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]


def body(request: Request, max_tokens: int, check: bool = False) -> dict:
    """The JSON body of `request` (`check`: as the agreement check sends it)."""
    extra = {"logprobs": 0, "return_token_ids": True} if check else {}
    return extra | {
        "model": request.model,
        "prompt": list(request.prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def complete(host: str, port: int, request: Request, max_tokens: int, check: bool = False) -> Completion:
    """Stream one completion; failures (HTTP status, a broken stream, a timeout) end up in `error`."""
    done = Completion(sent_s=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(host, port, body(request, max_tokens, check), done), TIMEOUT_S)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
        done.error = done.error or f"{type(e).__name__}: {e}"
    done.done_s = time.perf_counter()
    return done


async def send_all(
    host: str, port: int, requests: list[Request], concurrency: int, max_tokens: int, check: bool = False
) -> tuple[list[Completion], float]:
    """Every request, at most `concurrency` in flight (a new one starts as one ends); returns the
    completions in request order and the run's wall time, first send to last end."""
    gate = asyncio.Semaphore(concurrency)

    async def one(request: Request) -> Completion:
        async with gate:
            return await complete(host, port, request, max_tokens, check)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in requests))
    return list(results), time.perf_counter() - start


async def _stream(host: str, port: int, payload: dict, done: Completion) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = json.dumps(payload).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()
        status, headers = await _read_head(reader)
        chunks = _chunked(reader) if headers.get("transfer-encoding", "").lower() == "chunked" else _plain(reader)
        if status != 200:
            text = b"".join([c async for c in chunks]).decode(errors="replace")
            done.error = f"HTTP {status}: {text[:500]}"
            return
        await _read_events(chunks, done)
    finally:
        writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readline()).decode("latin-1")
    parts = status_line.split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise ValueError(f"not an HTTP response: {status_line!r}")
    headers = {}
    while (line := (await reader.readline()).decode("latin-1").strip()) != "":
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _chunked(reader: asyncio.StreamReader):
    """The body of a `Transfer-Encoding: chunked` response, chunk by chunk."""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF


async def _plain(reader: asyncio.StreamReader):
    """A body read to the connection's end."""
    while data := await reader.read(65536):
        yield data


async def _read_events(chunks, done: Completion) -> None:
    """Read SSE events (`data: {...}` then a blank line) until `data: [DONE]`."""
    buffer = b""
    async for data in chunks:
        buffer += data.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                _on_event(json.loads(payload), done)
    if done.error is None:
        done.error = "the stream ended before [DONE]"


def _on_event(event: dict, done: Completion) -> None:
    if "error" in event:
        done.error = str(event["error"])[:500]
        return
    choices = event.get("choices") or []
    if choices:
        done.chunk_s.append(time.perf_counter())
        done.text += "".join(c.get("text") or "" for c in choices)
        done.token_texts += [t for c in choices for t in (c.get("logprobs") or {}).get("tokens") or []]
        done.token_ids += [int(t) for c in choices for t in c.get("token_ids") or []]
    usage = event.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        done.tokens = int(usage["completion_tokens"])
