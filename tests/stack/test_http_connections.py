"""The HTTP port under idle, trickling and too many connections: a real gateway process with small
limits (`--http-max-connections 40`, 1 s head and body deadlines). Connections beyond the limit are
closed at once, trickling clients are cut off at their deadline, the gateway's open descriptors
stay bounded, and a well-behaved request and the gRPC health check are answered throughout.
Without the limits, uvicorn kept every connection open for as long as its client liked. A second
gateway keeps the default `--http-keep-alive`: clients reuse connections idle longer than their
pools' expiry, and idle keep-alive connections make room for new ones at the limit."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import selectors
import socket
import ssl
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from certs import CertificateAuthority
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack import LoneGateway, lone_gateway

from loraserve.errors import InvalidConfigError
from loraserve.gateway.http.connections import (
    DESCRIPTOR_HEADROOM,
    MAX_HEAD_BYTES,
    ConnectionLimits,
    ensure_descriptors,
    guarded_protocol,
)

pytestmark = pytest.mark.slow
MAX_CONNECTIONS = 40
DEADLINE_S = 1.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[LoneGateway]:
    flags = ["--http-max-connections", str(MAX_CONNECTIONS)]
    flags += ["--http-header-timeout", str(DEADLINE_S), "--http-body-timeout", str(DEADLINE_S)]
    flags += ["--http-keep-alive", str(DEADLINE_S)]
    with lone_gateway(tmp_path_factory.mktemp("connections"), *flags) as started:
        yield started


def _open(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def _closed_by_server(sock: socket.socket, within_s: float) -> bytes | None:
    """What the server sent before closing `sock` within `within_s`, or None if it stayed open."""
    sock.settimeout(within_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


def _app_status(gateway: LoneGateway) -> int:
    """The status of a request the app itself answers without a backend (a body missing `model`: 400);
    a refused connection gets 503 with no body."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{gateway.http_port}/v1/completions",
        data=b"{}",
        headers={"Authorization": f"Bearer {gateway.key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code if e.code != 400 or "model" in json.load(e)["error"]["message"] else -1
    except OSError:
        return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_silent_connections_beyond_the_limit_make_room_oldest_first_and_are_answered_503(gateway):
    """Connections that send nothing: each one beyond the limit takes the place of the oldest silent one,
    which is answered 503 and closed at once; the newest MAX_CONNECTIONS stay, and descriptors are bounded."""
    time.sleep(0.2)  # what earlier tests opened is closed
    before = _fds(gateway.process.pid)
    held = _open(gateway.http_port, MAX_CONNECTIONS)
    extra: list[socket.socket] = []
    try:
        time.sleep(0.2)  # the gateway has accepted them all
        extra = _open(gateway.http_port, 5 * MAX_CONNECTIONS)
        answers = _answers(held + extra, within_s=DEADLINE_S / 2)  # before any head deadline
        evicted, kept = answers[: 5 * MAX_CONNECTIONS], answers[5 * MAX_CONNECTIONS :]
        assert all(a is not None and a.startswith(b"HTTP/1.1 503") for a in evicted), evicted
        assert kept == [None] * MAX_CONNECTIONS, kept
        assert _fds(gateway.process.pid) <= before + MAX_CONNECTIONS + 5
    finally:
        for sock in held + extra:
            sock.close()


def test_a_client_gets_in_at_once_while_silent_connections_hold_every_slot(gateway):
    """The flood of connections that never send a request cannot keep a well-behaved client out: its
    request is answered at once, not after the flood's head deadlines."""
    time.sleep(0.2)
    held = _open(gateway.http_port, MAX_CONNECTIONS)
    try:
        time.sleep(0.2)
        started = time.monotonic()
        assert _app_status(gateway) == 400  # the app's own answer: the request got in
        assert time.monotonic() - started < DEADLINE_S / 2
    finally:
        for sock in held:
            sock.close()


def test_a_new_connection_is_refused_when_every_open_one_has_sent_a_request(gateway):
    """Connections in the middle of a request (a body still owed) are not made to give way."""
    time.sleep(0.2)
    busy = _open(gateway.http_port, MAX_CONNECTIONS)
    extra: list[socket.socket] = []
    try:
        for sock in busy:
            sock.sendall(_head(gateway, "POST", 100))  # a head, and a body that does not come yet
        time.sleep(0.2)
        extra = _open(gateway.http_port, 5)
        answers = _answers(extra, within_s=DEADLINE_S / 2)
        assert all(a is not None and a.startswith(b"HTTP/1.1 503") for a in answers), answers
        assert _answers(busy, within_s=0.05) == [None] * MAX_CONNECTIONS  # none of them was closed
    finally:
        for sock in busy + extra:
            sock.close()


def _answers(socks: list[socket.socket], within_s: float) -> list[bytes | None]:
    """What the server sent on each of `socks` before closing it, or None where it is still open
    after `within_s` (one deadline for all)."""
    received: dict[socket.socket, bytes] = {sock: b"" for sock in socks}
    open_ = set(socks)
    deadline = time.monotonic() + within_s
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while open_ and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                sock = key.fileobj
                try:
                    chunk = sock.recv(4096)
                except ConnectionResetError:
                    chunk = b""
                received[sock] += chunk
                if not chunk:
                    open_.discard(sock)
                    selector.unregister(sock)
    return [None if sock in open_ else received[sock] for sock in socks]


def test_idle_trickling_and_kept_alive_clients_are_cut_off_at_their_deadline(gateway):
    """Each one that owes a head or a body is answered 408 (no response has begun) and closed at its deadline; an
    idle keep-alive one is closed with no answer. On h11 a body's deadline closed it with no answer: h11 counts a
    response as begun once a request head is read."""
    idle = _open(gateway.http_port, 5)
    head = _open(gateway.http_port, 5)
    body = _open(gateway.http_port, 5)
    kept = _open(gateway.http_port, 5)
    for sock in head:  # a well-formed head that never ends: one header's value, trickled below
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-trickle: ")
    for sock in body:  # a whole head announcing a body that never comes whole
        sock.sendall(_head(gateway, "POST", length=100) + b"{")
    for sock in kept:  # one whole request answered (400: no `model`), then nothing: an idle keep-alive
        sock.sendall(_head(gateway, "POST", length=2) + b"{}")
    started = time.monotonic()
    closed: dict[socket.socket, float] = {}
    answers: dict[socket.socket, bytes] = {sock: b"" for sock in idle + head + body + kept}
    while len(closed) < len(answers) and time.monotonic() < started + 3 * DEADLINE_S:
        for sock in head + body:  # a byte every 0.1 s: each keeps uvicorn's own keep-alive timer at bay
            with contextlib.suppress(OSError):
                sock.send(b"x" if sock in head else b" ")
        for sock, chunk in _readable(set(answers) - set(closed), within_s=0.1).items():
            answers[sock] += chunk
            if not chunk:
                closed[sock] = time.monotonic() - started
    assert len(closed) == len(answers), f"{len(answers) - len(closed)} still open after {3 * DEADLINE_S} s"
    assert all(0.8 * DEADLINE_S <= t <= DEADLINE_S + 1.0 for t in closed.values()), sorted(closed.values())
    for sock in idle + head + body:
        assert answers[sock].startswith(b"HTTP/1.1 408"), answers[sock]
    for sock in kept:
        assert answers[sock].startswith(b"HTTP/1.1 400") and b"408" not in answers[sock], answers[sock]
    for sock in answers:
        sock.close()


def test_a_request_head_is_bounded_in_size_until_it_is_whole(gateway):
    """A head still not whole past MAX_HEAD_BYTES, however it is trickled, is answered 400 and closed at once (as
    h11 bounded it; llhttp alone buffers any size until the head deadline); a whole head of nearly that size
    is read."""
    line = b"x-pad: " + b"a" * 1000 + b"\r\n"
    big = _open(gateway.http_port, 1)[0]
    big.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    for _ in range(MAX_HEAD_BYTES // len(line) + 1):
        time.sleep(0.01)
        with contextlib.suppress(OSError):
            big.sendall(line)
    answer = _answers([big], within_s=DEADLINE_S / 2)[0]
    assert answer is not None and answer.startswith(b"HTTP/1.1 400"), answer
    near = _open(gateway.http_port, 1)[0]
    near.sendall(_head(gateway, "POST", length=2).replace(b"\r\n\r\n", b"\r\n" + line * 14 + b"\r\n") + b"{}")
    answer = _answers([near], within_s=DEADLINE_S + 1.0)[0]  # answered, then closed as an idle keep-alive
    assert answer is not None and answer.startswith(b"HTTP/1.1 400") and b"model" in answer, answer
    for sock in (big, near):
        sock.close()


def test_an_http11_head_without_host_is_answered_400_and_an_http10_one_is_served(gateway):
    """RFC 9112 3.2: a server answers 400 to an HTTP/1.1 request that lacks Host (before the app reads it); HTTP/1.0
    has no Host to require, so its request reaches the app (400 there: the body names no `model`)."""
    for version in (b"HTTP/1.1", b"HTTP/1.0"):
        sock = _open(gateway.http_port, 1)[0]
        sock.sendall(_head(gateway, "POST", length=2).replace(b"HTTP/1.1\r\nhost: x", version) + b"{}")
        answer = _answers([sock], within_s=DEADLINE_S + 1.0)[0]
        assert answer is not None and answer.startswith(b"HTTP/1.1 400"), (version, answer)
        assert (b"model" in answer) == (version == b"HTTP/1.0"), (version, answer)
        sock.close()


def test_the_port_is_served_by_uvicorns_httptools_protocol():
    """The C parser and framing (the gateway's CPU per streamed token, docs/benchmarks.md), with the bounds the
    tests above hold it to."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert issubclass(guarded_protocol(ConnectionLimits()), HttpToolsProtocol)


def _head(gateway: LoneGateway, method: str, length: int) -> bytes:
    return (
        f"{method} /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {gateway.key}\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


def _readable(socks: set[socket.socket], within_s: float) -> dict[socket.socket, bytes]:
    """What each readable one of `socks` has to read within `within_s` (b"": closed by the server)."""
    ready: dict[socket.socket, bytes] = {}
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        for key, _ in selector.select(within_s):
            try:
                ready[key.fileobj] = key.fileobj.recv(4096)
            except ConnectionResetError:
                ready[key.fileobj] = b""
    return ready


def test_the_gateway_keeps_serving_while_its_connections_are_full(gateway):
    channel = grpc.insecure_channel(_grpc_address(gateway))
    health = health_pb2_grpc.HealthStub(channel)
    held = _open(gateway.http_port, MAX_CONNECTIONS + 50)
    try:
        health.Check(health_pb2.HealthCheckRequest(), timeout=5)  # answered (NOT_SERVING: no scheduler here)
        deadline = time.monotonic() + 3 * DEADLINE_S  # the idle ones time out, and a slot frees
        statuses = []
        while time.monotonic() < deadline and (not statuses or statuses[-1] != 400):
            statuses.append(_app_status(gateway))
            time.sleep(0.2)
        assert statuses[-1] == 400, statuses
    finally:
        for sock in held:
            sock.close()
        channel.close()


def _grpc_address(gateway: LoneGateway) -> str:
    return f"127.0.0.1:{gateway.http_port - 4}"


@pytest.mark.parametrize(
    "changes",
    [{"max_connections": 0}, {"header_timeout_s": 0.0}, {"body_timeout_s": float("inf")}, {"keep_alive_s": -1.0}],
)
def test_limits_that_would_switch_a_bound_off_are_refused(changes):
    with pytest.raises(InvalidConfigError):
        ConnectionLimits(**changes)


def test_the_open_file_limit_is_raised_to_what_the_connection_limit_needs(caplog):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (600, hard))
        ensure_descriptors(ConnectionLimits(max_connections=1000))
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 1000 + DESCRIPTOR_HEADROOM
        if hard != resource.RLIM_INFINITY:
            ensure_descriptors(ConnectionLimits(max_connections=hard))
            assert "raise the limit" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_tls_handshake_that_never_comes_is_cut_off_at_the_head_deadline(tmp_path):
    ca = CertificateAuthority(tmp_path, "good")
    server = ca.server("server")
    flags = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--http-header-timeout", str(DEADLINE_S)]
    with lone_gateway(tmp_path, *flags) as tls_gateway:
        silent = _open(tls_gateway.http_port, 20)  # connected, and never a ClientHello
        started = time.monotonic()
        answers = _answers(silent, within_s=DEADLINE_S + 1.0)
        assert all(a == b"" for a in answers), f"still open {time.monotonic() - started:.1f} s on: {answers}"
        context = ssl.create_default_context(cafile=str(ca.cert))
        request = http.client.HTTPSConnection("127.0.0.1", tls_gateway.http_port, context=context, timeout=5)
        request.request("POST", "/v1/completions", b"{}", {"Authorization": f"Bearer {tls_gateway.key}"})
        assert request.getresponse().status == 400  # answered by the app: the body names no model
        for sock in silent:
            sock.close()


KEPT_CAP = 8  # the kept_alive gateway's --http-max-connections
CLIENT_WAIT_S = 6.0  # longer than httpx's and undici's pool expiry (5 s, 4 s): an idle wait real clients make
KEPT_HEAD_DEADLINE_S = 3.0  # the kept_alive gateway's --http-header-timeout: shorter than CLIENT_WAIT_S


@pytest.fixture(scope="module")
def kept_alive(tmp_path_factory) -> Iterator[LoneGateway]:
    """A gateway with the default `--http-keep-alive`, a head deadline shorter than CLIENT_WAIT_S and room for
    KEPT_CAP connections."""
    flags = ["--http-max-connections", str(KEPT_CAP), "--http-header-timeout", str(KEPT_HEAD_DEADLINE_S)]
    with lone_gateway(tmp_path_factory.mktemp("kept-alive"), *flags) as started:
        yield started


def test_a_client_reusing_a_connection_idle_longer_than_common_pools_gets_every_answer(kept_alive):
    """The default keep-alive outlasts clients' pools, so the client, not the server, drops an idle connection.
    The openai SDK on an httpx pool that keeps connections 15 s (aiohttp's default) and http.client (which never
    checks a kept connection) each wait CLIENT_WAIT_S between two requests on one connection: both get both
    answers on the connection they opened. With a 5 s keep-alive (the old default) the gateway had closed it:
    http.client's second request failed on the closed connection (a broken pipe) and the pool had to
    open another; the head deadline (KEPT_HEAD_DEADLINE_S), which used to run from the previous response, does
    not cut an idle connection either."""
    import httpx
    import openai

    pool = httpx.Client(limits=httpx.Limits(keepalive_expiry=15.0))
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{kept_alive.http_port}/v1", api_key=kept_alive.key, max_retries=0, http_client=pool
    )
    plain = http.client.HTTPConnection("127.0.0.1", kept_alive.http_port, timeout=5)
    sdk_ports, plain_ports, statuses = [], [], []
    try:
        for turn in range(2):
            if turn:
                time.sleep(CLIENT_WAIT_S)
            with pytest.raises(openai.APIStatusError) as answer:  # the gateway's own 503: no store behind it
                client.completions.create(model="base", prompt="hi", max_tokens=1)
            assert answer.value.status_code == 503 and "adapter store" in answer.value.message
            sdk_ports.append(answer.value.response.extensions["network_stream"].get_extra_info("client_addr"))
            plain.request("POST", "/v1/completions", b"{}", {"Authorization": f"Bearer {kept_alive.key}"})
            plain_ports.append(plain.sock.getsockname())
            response = plain.getresponse()
            response.read()
            statuses.append(response.status)
        assert statuses == [400, 400]  # the app's answer (no `model`) both times
        assert sdk_ports[0] == sdk_ports[1] and plain_ports[0] == plain_ports[1]  # one connection each, reused
    finally:
        client.close()
        plain.close()


def _kept(gateway: LoneGateway, count: int) -> list[http.client.HTTPConnection]:
    """`count` connections that each sent one request and read its whole answer: idle between requests,
    the first idle longest."""
    kept = []
    for _ in range(count):
        connection = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=5)
        connection.request("POST", "/v1/completions", b"{}", {"Authorization": f"Bearer {gateway.key}"})
        with connection.getresponse() as response:
            assert response.status == 400
            response.read()
        kept.append(connection)
        time.sleep(0.02)  # a distinct idle order
    return kept


def test_connections_idle_between_requests_make_room_at_the_limit_after_silent_ones_oldest_first(kept_alive):
    """Long keep-alive cannot starve new clients: at the limit a new connection takes the place of one that never
    sent a request (answered 503), and when none is left, of the one idle longest between requests (closed with
    no answer, as at its keep-alive timeout: the client sends its next request on a new connection). One whose
    next request has begun is not idle, and is left alone. Before, only never-used connections made room: the
    new ones were answered 503 while idle keep-alive connections held the slots."""
    time.sleep(0.2)  # what earlier tests opened is closed
    kept = _kept(kept_alive, 5)
    silent = _open(kept_alive.http_port, KEPT_CAP - len(kept))
    kept[0].sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # its next request has begun: not idle
    time.sleep(0.1)  # the gateway has accepted them all, and read that
    newer = _kept(kept_alive, len(silent) + 2)  # each sends a request at once: three take the silent ones' places
    try:
        answers = _answers(silent + [c.sock for c in kept + newer], within_s=0.2)  # made room at once
        silent_answers, kept_answers = answers[: len(silent)], answers[len(silent) : len(silent) + len(kept)]
        assert all(a is not None and a.startswith(b"HTTP/1.1 503") for a in silent_answers), silent_answers
        assert kept_answers == [None, b"", b"", None, None], kept_answers  # the two idle longest, closed silently
        assert answers[len(silent) + len(kept) :] == [None] * len(newer)
    finally:
        for connection in kept + newer:
            connection.close()
        for sock in silent:
            sock.close()


def test_a_client_gets_in_at_once_while_idle_keep_alive_connections_hold_every_slot(kept_alive):
    """Connections idle between requests in every slot: a new client's request is answered at once, in the place
    of the one idle longest."""
    time.sleep(0.2)
    kept = _kept(kept_alive, KEPT_CAP)
    try:
        started = time.monotonic()
        assert _app_status(kept_alive) == 400  # the app's own answer: the request got in
        assert time.monotonic() - started < DEADLINE_S / 2
        assert _answers([c.sock for c in kept], within_s=0.1) == [b""] + [None] * (KEPT_CAP - 1)
    finally:
        for connection in kept:
            connection.close()
