"""A role asked for a metrics port it cannot bind stops with one clear line, not a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from stack import free_port_block


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_a_busy_metrics_port_is_a_clear_error(role):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        base = free_port_block(2)
        first, second = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
        addresses = {
            "scheduler": ["--bind", f"127.0.0.1:{base}", "--worker-address", second],
            "worker": ["--scheduler-address", first, "--store-address", second],
        }[role]
        out = subprocess.run(
            [sys.executable, "-m", "loraserve.cli", role, *addresses, "--metrics-port", str(port)],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr
