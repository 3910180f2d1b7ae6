"""The gateway's request metrics tell the truth about HTTP requests: a request answered in full counts
OK in `loraserve_gateway_requests_total`, one whose client went away counts CANCELLED.

A real stack (one worker, the demo model, `--metrics-port`) is sent real HTTP requests, streaming
and not, completions and chat; the test scrapes `/metrics` before and after. The worker is emulated,
with steps of STEP_S: a client that leaves after the first token does so long before its 480 tokens
could be generated, however loaded the machine (a real demo-model worker may finish them first).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections import Counter

import pytest
from emulated import fixed_profile
from stack import LocalStack, free_port_block, scrape_metrics

from loraserve.demo.assets import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow
PROMPT = "the quiet king"
STEP_S = 0.02  # 480 tokens: about 10 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    http_port, metrics_port = free_port_block(1), free_port_block(4)
    profile = fixed_profile(tmp_path_factory.mktemp("http-metrics") / "runner_profile.json", step_s=STEP_S)
    stack = LocalStack(
        DEMO_MODEL_DIR,
        workers=1,
        http_bind=f"127.0.0.1:{http_port}",
        metrics_port=metrics_port,
        runner="emulated",
        runner_profile=profile,
    )
    stack.http_port, stack.metrics_port = http_port, metrics_port
    stack.start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


def outcomes(stack) -> Counter[str]:
    """loraserve_gateway_requests_total by code, summed over tenants."""
    counts: Counter[str] = Counter()
    for (name, labels), value in scrape_metrics(stack.metrics_port).items():
        if name == "loraserve_gateway_requests_total":
            counts[dict(labels)["code"]] += int(value)
    return counts


def post(stack, path: str, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def wait_for(stack, expected: Counter[str], timeout_s: float = 5.0) -> Counter[str]:
    """The outcome counts once they reach `expected` (the count follows the answer by a moment)."""
    deadline = time.monotonic() + timeout_s
    while (counts := outcomes(stack)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return counts


def test_answered_requests_count_ok_and_nothing_else(stack):
    before = outcomes(stack)
    bodies = [
        ("/v1/completions", {"model": "upper", "prompt": PROMPT, "max_tokens": 4}),
        ("/v1/completions", {"model": "upper", "prompt": PROMPT, "max_tokens": 4, "stream": True}),
        ("/v1/chat/completions", {"model": "upper", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ("/v1/completions", {"model": "upper", "prompt": PROMPT, "max_tokens": 4, "stop": ["Q"], "stream": True}),
    ]
    for path, body in bodies:
        response = post(stack, path, body)
        assert response.status == 200, response.read()
        response.read()
    counts = wait_for(stack, before + Counter(OK=len(bodies)))
    assert counts - before == Counter(OK=len(bodies)), counts - before


def test_a_client_that_leaves_counts_cancelled(stack):
    before = outcomes(stack)
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    body = {"model": "upper", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert conn.getresponse().readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    counts = wait_for(stack, before + Counter(CANCELLED=1))
    assert counts - before == Counter(CANCELLED=1), counts - before
