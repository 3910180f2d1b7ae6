"""A listening address's port must be 0-65535: grpc's `add_insecure_port` and `getaddrinfo` take a larger one
modulo 65536 without a word (99999 listened on 34463), so every role refuses it before it binds anything,
naming the flag."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from loraserve.endpoints import listen_port
from loraserve.errors import InvalidConfigError
from loraserve.gateway.http.server import listen
from loraserve.grpc_utils import new_server

BAD = ["127.0.0.1:65536", "127.0.0.1:99999", "[::1]:70000", "127.0.0.1:-1", "127.0.0.1:", "127.0.0.1:８０", "x"]


@pytest.mark.parametrize("bind", ["127.0.0.1:0", "127.0.0.1:65535", "[::1]:7100", "localhost:80"])
def test_a_port_in_range_is_taken(bind):
    assert listen_port(bind) == int(bind.rpartition(":")[2])


@pytest.mark.parametrize("bind", BAD)
def test_a_port_out_of_range_is_refused_by_either_port(bind):
    with pytest.raises(InvalidConfigError, match=r"^--bind .*: the port must be 0-65535"):
        asyncio.run(_server(bind))
    with pytest.raises(InvalidConfigError, match=r"^--http-bind .*: the port must be 0-65535"):
        listen(bind)


async def _server(bind: str) -> None:
    server, _ = new_server(bind)
    await server.stop(None)


def test_a_role_given_such_a_port_exits_with_one_line():
    run = subprocess.run(
        [sys.executable, "-m", "loraserve.cli", "scheduler", "--bind", "127.0.0.1:99999"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 1
    assert "--bind '127.0.0.1:99999': the port must be 0-65535" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr + run.stdout
