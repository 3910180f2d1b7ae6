"""A role without internal keys serves its internal ports unauthenticated: it refuses to start when
one of them reaches beyond loopback (unless `--insecure-no-internal-auth`), and warns on loopback.
Real role processes; the refusals must come before anything listens."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from stack import free_port_block

from loraserve.endpoints import is_loopback
from loraserve.internal_auth import check_open_planes


def _role(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "loraserve.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _commands(base: int, tmp_path) -> dict[str, list[str]]:
    return {
        "scheduler": ["scheduler", "--bind", f"0.0.0.0:{base}", "--worker-address", f"tcp://127.0.0.1:{base + 1}"],
        "store": [
            "adapter-store",
            "--bind",
            f"127.0.0.1:{base + 2}",
            "--data-address",
            f"tcp://*:{base + 3}",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        "gateway": [
            "gateway",
            "--bind",
            f"127.0.0.1:{base + 4}",
            "--token-address",
            f"tcp://0.0.0.0:{base + 5}",
            "--scheduler",
            f"127.0.0.1:{base}",
            "--store",
            f"127.0.0.1:{base + 2}",
        ],
    }


def test_roles_with_internal_ports_beyond_loopback_and_no_keys_refuse_to_start(tmp_path):
    processes = {role: _role(*command) for role, command in _commands(free_port_block(6), tmp_path).items()}
    for role, process in processes.items():
        output, _ = process.communicate(timeout=60)
        assert process.returncode != 0, f"{role} started: {output[-2000:]}"
        assert "without authentication" in output and "--internal-keys" in output, output[-2000:]
        assert "--insecure-no-internal-auth" in output
        assert "Traceback" not in output


@pytest.mark.parametrize("bind", ["0.0.0.0", "127.0.0.1"])
def test_a_scheduler_told_so_or_on_loopback_starts_with_a_warning(bind):
    base = free_port_block(2)
    command = ["scheduler", "--bind", f"{bind}:{base}", "--worker-address", f"tcp://127.0.0.1:{base + 1}"]
    if bind == "0.0.0.0":
        command.append("--insecure-no-internal-auth")
    process = _role(*command)
    try:
        time.sleep(0.5)
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("scheduler: gRPC on" in line for line in lines):
            line = process.stdout.readline()
            assert line, "".join(lines)[-2000:]
            lines.append(line)
        warning = [line for line in lines if "WARNING" in line and "no --internal-keys" in line]
        assert warning, "".join(lines)[-2000:]
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize(
    ("bind", "loopback"),
    [
        ("tcp://127.0.0.1:7101", True),
        ("tcp://[::1]:7101", True),
        ("ipc:///tmp/x.sock", True),
        ("tcp://*:7101", False),
        ("tcp://0.0.0.0:7101", False),
        ("tcp://scheduler:7101", False),
        ("0.0.0.0:7100", False),
        ("localhost:7100", True),
    ],
)
def test_which_addresses_count_as_loopback(bind, loopback):
    assert is_loopback(bind) is loopback


def test_keys_switch_the_check_off():
    check_open_planes("scheduler", object(), ["tcp://*:7101"], insecure=False)  # type: ignore[arg-type]
