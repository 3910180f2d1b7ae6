"""The HTTP port under idle, trickling and too many connections: a real gateway process with small
limits (`--http-max-connections 40`, 1 s head and body deadlines). Connections beyond the limit are
closed at once, trickling clients are cut off at their deadline, the gateway's open descriptors
stay bounded, and a well-behaved request and the gRPC health check are answered throughout.
Without the limits, uvicorn kept every connection open for as long as its client liked."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack import LoneGateway, lone_gateway

from loraserve.errors import InvalidConfigError
from loraserve.gateway.http.connections import DESCRIPTOR_HEADROOM, ConnectionLimits, ensure_descriptors

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


def test_connections_beyond_the_limit_are_answered_503_and_closed_at_once(gateway):
    held = _open(gateway.http_port, MAX_CONNECTIONS)
    try:
        time.sleep(0.2)  # the gateway has accepted them all
        extra = _open(gateway.http_port, 20)
        answers = [_closed_by_server(sock, within_s=0.5) for sock in extra]
        assert all(a is not None and a.startswith(b"HTTP/1.1 503") for a in answers), answers
        assert _fds(gateway.process.pid) < 200
    finally:
        for sock in held + extra:
            sock.close()


def test_idle_and_trickling_clients_are_cut_off_at_their_deadline(gateway):
    idle = _open(gateway.http_port, 5)
    head = _open(gateway.http_port, 5)
    body = _open(gateway.http_port, 5)
    started = time.monotonic()
    for sock in body:  # a whole head announcing a body that never comes whole
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {gateway.key}\r\ncontent-length: 100\r\n\r\n{{".encode()
        )
    for _ in range(int(3 * DEADLINE_S / 0.2)):  # a byte of head every 0.2 s, on each
        for sock in head + body:
            with contextlib.suppress(OSError):
                sock.send(b"x" if sock in head else b" ")
        time.sleep(0.2)
    for sock in idle + head + body:
        answer = _closed_by_server(sock, within_s=0.5)
        assert answer is not None, f"still open {time.monotonic() - started:.1f} s after connecting"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer
        sock.close()


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
