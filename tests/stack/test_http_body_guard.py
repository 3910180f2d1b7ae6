"""The HTTP port refuses before it reads a body: 401 without a valid key, 413 over the size cap.

A real gateway process (alone: no scheduler or store behind it) with an auth file is sent 2 GiB
bodies over a real socket, generated on the fly from one small buffer, announced by Content-Length
or chunked (no length). The client reads while it sends, as a browser does, so an early answer is
seen as soon as it comes. Each must be answered quickly, long before 2 GiB has gone, and the
gateway's resident memory must stay within `RSS_GROWTH_BOUND` of what it was before. Without the
guard, the gateway read the whole body before it looked at the key or the size. The units at the
end drive `BodyGuard` directly with a `receive` that never ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest
from stack import LoneGateway, lone_gateway

from loraserve.errors import UnauthenticatedError
from loraserve.gateway.http.body_guard import BodyGuard
from loraserve.gateway.validation import Limits

pytestmark = pytest.mark.slow
KEY = "key-of-a-0123456789"
BODY_BYTES = 2 << 30  # 2 GiB
CAP = 2 * Limits(vocab_size=1, max_context=1).max_prompt_bytes + (1 << 16)  # the gateway's body cap
RSS_GROWTH_BOUND = 64 << 20  # the gateway's resident memory may grow this much while refusing
ANSWER_WITHIN_S = 5.0
PIECE = b"x" * (1 << 20)  # what the client sends, over and over


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[LoneGateway]:
    with lone_gateway(tmp_path_factory.mktemp("guard"), key=KEY) as started:
        yield started


class PeakRss:
    """The largest resident set size of process `pid` while the `with` block runs (sampled every 10 ms)."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)  # memory the refusal left behind counts too
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.before


@dataclass
class Answer:
    status: int
    body: dict
    sent: int  # body bytes the client got to send
    seconds: float


def upload(port: int, key: str | None, chunked: bool, total: int = BODY_BYTES) -> Answer:
    """POST a `total`-byte body to /v1/completions, reading while sending; the answer once it is whole."""
    head = [
        "POST /v1/completions HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}",
    ]
    if key is not None:
        head.append(f"Authorization: Bearer {key}")
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    sock.setblocking(False)
    pieces = _body(total, chunked)
    started, sent, received, pending = time.monotonic(), 0, b"", memoryview(b"")
    sending = True
    try:
        while not _whole(received):
            assert time.monotonic() - started < 4 * ANSWER_WITHIN_S, f"no answer after {sent} bytes sent"
            readable, writable, _ = select.select([sock], [sock] if sending else [], [], 0.5)
            if readable:
                with contextlib.suppress(ConnectionResetError):
                    data = sock.recv(65536)
                    received += data
                    if data:
                        continue
                break  # closed: what came is the answer
            if writable:
                if not pending:
                    pending = memoryview(next(pieces, b""))
                    sending = bool(pending)
                try:
                    n = sock.send(pending)
                except (BrokenPipeError, ConnectionResetError):
                    sending = False  # the server closed its end; its answer may be waiting
                    continue
                pending, sent = pending[n:], sent + n
    finally:
        sock.close()
    seconds = time.monotonic() - started
    assert _whole(received), f"an incomplete answer: {received[:300]!r}"
    header, _, body = received.partition(b"\r\n\r\n")
    return Answer(int(header.split()[1]), json.loads(body), sent, seconds)


def _body(total: int, chunked: bool) -> Iterator[bytes]:
    """`total` bytes of body, made on the fly from `PIECE` (as chunks of chunked encoding when `chunked`)."""
    while total > 0:
        piece = PIECE[: min(total, len(PIECE))]
        total -= len(piece)
        yield (b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece
    if chunked:
        yield b"0\r\n\r\n"


def _whole(received: bytes) -> bool:
    header, separator, body = received.partition(b"\r\n\r\n")
    if not separator:
        return False
    lengths = [line.split(b":", 1)[1] for line in header.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(lengths) and len(body) >= int(lengths[0])


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("key", [None, "not-a-key"], ids=["no-key", "unknown-key"])
def test_a_2gib_body_without_a_valid_key_is_refused_401_before_it_is_read(gateway, key, chunked):
    with PeakRss(gateway.process.pid) as rss:
        answer = upload(gateway.http_port, key, chunked)
    assert answer.status == 401 and answer.body["error"]["type"] == "authentication_error", answer
    assert answer.seconds < ANSWER_WITHIN_S, answer
    assert answer.sent < BODY_BYTES // 8, answer  # the client was cut off long before the end
    assert rss.growth < RSS_GROWTH_BOUND, f"the gateway grew {rss.growth >> 20} MiB"
    assert gateway.process.poll() is None


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_2gib_body_with_a_valid_key_is_refused_413_early(gateway, chunked):
    with PeakRss(gateway.process.pid) as rss:
        answer = upload(gateway.http_port, KEY, chunked)
    assert answer.status == 413 and str(CAP) in answer.body["error"]["message"], answer
    assert answer.seconds < ANSWER_WITHIN_S, answer
    assert answer.sent < BODY_BYTES // 8, answer
    assert rss.growth < RSS_GROWTH_BOUND, f"the gateway grew {rss.growth >> 20} MiB"


def test_bodies_within_the_cap_still_reach_the_routes(gateway):
    """The control: a key and a body under the cap, announced or chunked, are read and validated (a JSON
    body of `CAP - 1` bytes is not valid JSON, so 400 from the routes, not 413 from the guard)."""
    for chunked in (False, True):
        answer = upload(gateway.http_port, KEY, chunked, total=CAP - len(PIECE) // 2)
        assert answer.status == 400 and answer.body["error"]["param"] == "body", answer


# ---- units: BodyGuard alone ---------------------------------------------------------------------


def _authenticate(headers: dict[str, str]) -> None:
    if headers.get("authorization") != f"Bearer {KEY}":
        raise UnauthenticatedError("a valid API key is required")


async def _drive(guard: BodyGuard, headers: list[tuple[bytes, bytes]]) -> tuple[list[dict], int]:
    """Run `guard` on a request whose body never ends (64 KiB a message); (messages sent, receive calls)."""
    calls, sent = 0, []

    async def receive() -> dict:
        nonlocal calls
        calls += 1
        return {"type": "http.request", "body": b"y" * 65536, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    await guard(scope, receive, send)
    return sent, calls


async def _never_called(scope, receive, send) -> None:
    raise AssertionError("the app behind the guard ran")


def test_the_guard_reads_no_body_without_a_key_and_no_more_than_the_cap_with_one():
    guard = BodyGuard(_never_called, _authenticate, max_body_bytes=1 << 20)
    sent, calls = asyncio.run(_drive(guard, []))
    assert sent[0]["status"] == 401 and calls == 0
    assert (b"connection", b"close") in sent[0]["headers"]
    sent, calls = asyncio.run(_drive(guard, [(b"authorization", f"Bearer {KEY}".encode())]))
    assert sent[0]["status"] == 413 and calls == (1 << 20) // 65536 + 1
    length = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-length", b"1048577")]
    sent, calls = asyncio.run(_drive(guard, length))
    assert sent[0]["status"] == 413 and calls == 0
