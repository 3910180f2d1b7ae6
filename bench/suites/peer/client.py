"""One OpenAI-compatible streaming client for both systems: POST /v1/completions, stream=true, SSE.

httpx over HTTP/1.1, one connection pool per run (as many connections as requests in flight), so
the two systems get byte-for-byte the same client and the same per-chunk client cost. Each
request is greedy (temperature 0), `max_tokens` fixed and `ignore_eos` set (both servers take
vLLM's extension), with `stream_options.include_usage` so the last chunk counts the tokens. The
agreement check's requests (`check=True`) also ask for `logprobs: 0` (each chunk names its tokens'
texts) and `return_token_ids` (vLLM's extension: the ids; loraserve ignores it); the timed runs ask
for neither.

    results, seconds = asyncio.run(send_all("127.0.0.1", 8000, requests, concurrency=8, max_tokens=64))
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

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


async def complete(http: httpx.AsyncClient, request: Request, max_tokens: int, check: bool = False) -> Completion:
    """Stream one completion; failures (HTTP status, a broken stream, a timeout) end up in `error`."""
    done = Completion(sent_s=time.perf_counter())
    try:
        async with asyncio.timeout(TIMEOUT_S):
            await _stream(http, body(request, max_tokens, check), done)
    except (httpx.HTTPError, OSError, TimeoutError, ValueError) as e:
        done.error = done.error or f"{type(e).__name__}: {e}"
    done.done_s = time.perf_counter()
    return done


async def send_all(
    host: str, port: int, requests: list[Request], concurrency: int, max_tokens: int, check: bool = False
) -> tuple[list[Completion], float]:
    """Every request, at most `concurrency` in flight (a new one starts as one ends); returns the
    completions in request order and the run's wall time, first send to last end."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=TIMEOUT_S, limits=limits) as http:

        async def one(request: Request) -> Completion:
            async with gate:
                return await complete(http, request, max_tokens, check)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        return list(results), time.perf_counter() - start


async def _stream(http: httpx.AsyncClient, payload: dict, done: Completion) -> None:
    headers = {"Accept": "text/event-stream"}
    async with http.stream("POST", "/v1/completions", json=payload, headers=headers) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            done.error = f"HTTP {response.status_code}: {text[:500]}"
            return
        await _read_events(response.aiter_lines(), done)


async def _read_events(lines: AsyncIterator[str], done: Completion) -> None:
    """Read SSE `data:` lines until `data: [DONE]`."""
    async for line in lines:
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
