"""A role without internal keys serves its internal ports unauthenticated: it refuses to start when
one of them reaches beyond loopback (unless `--insecure-no-internal-auth`), and warns on loopback.
Real role processes; the refusals must come before anything listens."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from stack import free_port_block

from loraserve.endpoints import is_loopback
from loraserve.internal_auth import check_open_planes


def _role(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LORASERVE_")} | (env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "loraserve.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment,
    )


def _exit_output(role: str, process: subprocess.Popen, timeout_s: float = 30.0) -> str:
    """What `process` wrote before it exited; fails (and stops it) when it is still running."""
    try:
        return process.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        output = process.communicate()[0]
        pytest.fail(f"the {role} started instead of refusing: {output[-2000:]}")


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
    base = free_port_block(6)
    public = {"scheduler": f"0.0.0.0:{base}", "store": f"tcp://*:{base + 3}", "gateway": f"tcp://0.0.0.0:{base + 5}"}
    processes = {role: _role(*command) for role, command in _commands(base, tmp_path).items()}
    for role, process in processes.items():
        output = _exit_output(role, process)
        assert process.returncode != 0, f"{role} started: {output[-2000:]}"
        assert "without authentication" in output and public[role] in output, output[-2000:]
        assert "--internal-keys" in output and "--insecure-no-internal-auth" in output, output[-2000:]
        assert "Traceback" not in output


@pytest.mark.parametrize(
    ("bind", "told"),
    [("0.0.0.0", "flag"), ("0.0.0.0", "env"), ("127.0.0.1", None)],
    ids=["public-flag", "public-env", "loopback"],
)
def test_a_scheduler_told_so_or_on_loopback_starts_with_a_warning(bind, told):
    base = free_port_block(2)
    command = ["scheduler", "--bind", f"{bind}:{base}", "--worker-address", f"tcp://127.0.0.1:{base + 1}"]
    if told == "flag":
        command.append("--insecure-no-internal-auth")
    env = {"LORASERVE_INSECURE_NO_INTERNAL_AUTH": "1"} if told == "env" else None
    process = _role(*command, env=env)
    try:
        lines = _lines_until(process, "scheduler: gRPC on")
        warning = [line for line in lines if "WARNING" in line and "no --internal-keys" in line]
        assert warning, "".join(lines)[-2000:]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_worker_without_keys_starts_with_a_warning():
    """A worker listens nowhere: it never refuses, but says that its connections are unauthenticated."""
    base = free_port_block(2)
    process = _role(
        "worker", "--scheduler-address", f"tcp://127.0.0.1:{base}", "--store-address", f"tcp://127.0.0.1:{base + 1}"
    )
    try:
        lines = _lines_until(process, "no --internal-keys")
        assert "WARNING" in lines[-1] and "worker" in lines[-1], lines[-1]
    finally:
        process.terminate()
        process.wait(timeout=30)


def _lines_until(process: subprocess.Popen, text: str) -> list[str]:
    """The process's output lines up to the first one containing `text` (fails if it exits first)."""
    lines: list[str] = []
    while not lines or text not in lines[-1]:
        line = process.stdout.readline()
        assert line, f"exited with {process.wait()} before saying {text!r}: {''.join(lines)[-2000:]}"
        lines.append(line)
    return lines


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
