"""The audit trail of a running stack: the gateway process writes one `loraserve.audit` line per
adapter administration (upload, delete, refused ones too) and per key reload, naming the tenant,
the adapter, the version and the outcome, and never the key. Real processes; the roles' output is
read where they write it (the test's own descriptors, which they inherit)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from stack import LocalStack

from loraserve.client import ApiError, Client
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.gateway.keys import new_key

pytestmark = pytest.mark.slow


def _audit_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "loraserve.audit" in line]


def _wait_for(capfd, pattern: str, seen: list[str], timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        captured = capfd.readouterr()  # the roles log to stderr
        seen += _audit_lines(captured.err)
        found = [line for line in seen if re.search(pattern, line)]
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no audit line matches {pattern!r}; audit lines: {seen}")


def test_the_gateway_writes_an_audit_line_per_administrative_action(tmp_path, capfd):
    key, digest = new_key()
    auth = tmp_path / "auth.toml"
    tenant = f'[[tenants]]\nname = "acme"\napi_key_sha256 = ["{digest}"]\nscopes = ["generate", "adapters"]\n'
    auth.write_text(tenant)
    stack = LocalStack(
        DEMO_MODEL_DIR, 1, auth_file=str(auth), child_log_level="INFO", data_dir=str(tmp_path / "data")
    ).start()
    seen: list[str] = []
    try:
        with Client(stack.address, api_key=key) as client:
            adapter = next(iter(sorted(demo_adapters().items())))[1]
            version = client.upload_adapter("mine", adapter, timeout=60).version
            _wait_for(capfd, rf"action=upload tenant=acme adapter=acme~mine version={version} outcome=OK", seen)
            client.delete_adapter("mine", timeout=30)
            _wait_for(capfd, r"action=delete tenant=acme adapter=acme~mine .*outcome=OK", seen)
            with pytest.raises(ApiError):
                client.delete_adapter("absent", timeout=30)
            _wait_for(capfd, r"action=delete tenant=acme adapter=\S*absent .*outcome=NOT_FOUND", seen)
        with pytest.raises(ApiError), Client(stack.address, api_key="not-a-key") as stranger:
            stranger.delete_adapter("mine", timeout=30)
        _wait_for(capfd, r"action=delete tenant=unauthenticated .*outcome=UNAUTHENTICATED", seen)
        os.kill(stack.process("gateway").pid, signal.SIGHUP)
        _wait_for(capfd, r"action=reload_keys .*outcome=OK", seen)
        assert not [line for line in seen if key in line or digest in line]
    finally:
        stack.stop()
