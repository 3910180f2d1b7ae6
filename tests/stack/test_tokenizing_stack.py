"""Tokenizing never stalls the gateway, and tokenizer calls are metered: a real stack, real processes.

- While 4 clients send 1 MiB prompts to `/tokenize`, `/v1/completions`, `/v1/chat/completions` and
  gRPC `Tokenize`, another client's HTTP `/health` and gRPC health check answer within `HEALTH_S`
  each, and the gateway stays SERVING; every 1 MiB prompt is refused 400 / INVALID_ARGUMENT naming
  its field (and the byte bound) at once, before any tokenizing.
- `/tokenize` and gRPC `Tokenize` take one of the tenant's `max_concurrent` slots: over it, 429 with
  Retry-After (RESOURCE_EXHAUSTED with `retry-after-ms`), and they are counted by outcome and tenant.
- A request of several choices of which one is refused over the quota leaves no "aclose(): asynchronous
  generator is already running" (nor any traceback) in the gateway's log.

The worker is emulated (fast steps): what is under test is the gateway.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import time
from collections import Counter
from email.message import Message

import grpc
import pytest
from emulated import fixed_profile
from stack import LocalStack, free_port_block, scrape_metrics

from loraserve.bench.suites.abuse.attacks import HealthProbe
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.grpc_utils import RETRY_AFTER_KEY
from loraserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.slow
KEYS = {name: f"key-of-{name}-0123456789" for name in ("a", "q", "r")}
TENANTS = {"a": "", "q": "max_concurrent = 1", "r": "max_concurrent = 2"}
MIB = 1 << 20
BIG = "the quiet king " * (MIB // 15)  # 1 MiB less one byte: under the 1 MiB prompt cap, over the byte bound
HEALTH_S = 0.5
FLOOD_S = 6.0
CLIENTS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("tokenizing")
    auth = home / "auth.toml"
    auth.write_text(
        "".join(
            f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{hashlib.sha256(KEYS[name].encode()).hexdigest()}"]\n'
            f'scopes = ["generate"]\n{quota}\n\n'
            for name, quota in TENANTS.items()
        )
    )
    http_port, metrics_port = free_port_block(1), free_port_block(4)
    stack = LocalStack(
        DEMO_MODEL_DIR,
        workers=1,
        auth_file=str(auth),
        http_bind=f"127.0.0.1:{http_port}",
        metrics_port=metrics_port,
        runner="emulated",
        runner_profile=fixed_profile(home / "runner_profile.json", step_s=0.02),
    )
    stack.http_port, stack.metrics_port = http_port, metrics_port
    stack.start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


def post(stack, path: str, body: dict, tenant: str = "a", timeout_s: float = 60.0) -> tuple[int, dict, Message]:
    """(status, JSON body, headers: any case) of one HTTP request on a connection of its own."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[tenant]}"}
        connection.request("POST", path, json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}"), response.headers
    finally:
        connection.close()


def metadata(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def _flood(stack) -> Counter:
    """CLIENTS threads sending 1 MiB prompts for FLOOD_S; each answer as (target, status, field, seconds)."""
    chat = {"model": "model", "messages": [{"role": "user", "content": BIG}]}
    targets = [
        ("tokenize", lambda: post(stack, "/tokenize", {"prompt": BIG})),
        ("completions", lambda: post(stack, "/v1/completions", {"model": "model", "prompt": BIG})),
        ("chat", lambda: post(stack, "/v1/chat/completions", chat)),
    ]
    answers: Counter = Counter()
    slowest = [0.0]
    lock, stop = threading.Lock(), threading.Event()

    def grpc_tokenize(api) -> tuple[str, dict, None]:
        try:
            api.Tokenize(gateway_pb2.TokenizeRequest(text=BIG), timeout=60, metadata=metadata("a"))
            return "OK", {}, None
        except grpc.RpcError as e:
            return e.code().name, {"error": {"param": e.details().split(":", 1)[0]}}, None

    def loop(index: int) -> None:
        with grpc.insecure_channel(stack.address, options=[("grpc.max_send_message_length", 4 * MIB)]) as channel:
            api = gateway_pb2_grpc.LoraServeStub(channel)
            calls = [*targets, ("grpc_tokenize", lambda: grpc_tokenize(api))]
            n = index
            while not stop.is_set():
                name, call = calls[n % len(calls)]
                started = time.monotonic()
                status, body, _ = call()
                took = time.monotonic() - started
                with lock:
                    answers[(name, status, body.get("error", {}).get("param"))] += 1
                    slowest[0] = max(slowest[0], took)
                n += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    time.sleep(FLOOD_S)
    stop.set()
    for thread in threads:
        thread.join(120)
    answers["slowest_ms"] = int(slowest[0] * 1000)
    return answers


def test_1mib_prompts_are_refused_at_once_and_never_stall_health(stack):
    with HealthProbe(f"127.0.0.1:{stack.http_port}", stack.address, interval_s=0.05) as probe:
        answers = _flood(stack)
    slowest_ms = answers.pop("slowest_ms")
    assert probe.http_s and probe.grpc_s
    worst = {"http_health_s": round(max(probe.http_s), 3), "grpc_health_s": round(max(probe.grpc_s), 3)}
    assert max(worst.values()) < HEALTH_S and probe.not_serving == 0, (worst, probe.not_serving, answers)
    expected = {
        ("tokenize", 400, "prompt"),
        ("completions", 400, "prompt"),
        ("chat", 400, "messages"),
        ("grpc_tokenize", "INVALID_ARGUMENT", "text"),
    }
    assert set(answers) == expected, answers  # every one refused, naming its field
    assert sum(answers.values()) >= 4 * CLIENTS, answers
    assert slowest_ms < 2000, slowest_ms  # at once: never tokenized
    _, body, _ = post(stack, "/tokenize", {"prompt": BIG})
    assert "cannot fit the context length of 512 tokens" in body["error"]["message"], body


def test_tokenize_takes_a_slot_over_max_concurrent_is_429_and_is_counted(stack):
    assert post(stack, "/tokenize", {"prompt": "the quiet king"}, tenant="q")[0] == 200
    held = stack.api.GenerateStream(
        gateway_pb2.GenerateRequest(
            text="the quiet king", max_new_tokens=400, sampling=common_pb2.SamplingParameters(ignore_eos=True)
        ),
        timeout=60,
        metadata=metadata("q"),
    )
    try:
        next(held)  # q's one slot is taken
        status, body, headers = post(stack, "/tokenize", {"prompt": "the quiet king"}, tenant="q")
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
        assert int(headers["Retry-After"]) >= 1
        assert post(stack, "/detokenize", {"tokens": [5, 6]}, tenant="q")[0] == 429
        with pytest.raises(grpc.RpcError) as refused:
            stack.api.Tokenize(gateway_pb2.TokenizeRequest(text="the quiet king"), timeout=10, metadata=metadata("q"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(refused.value.trailing_metadata())[RETRY_AFTER_KEY] == "500"
        assert post(stack, "/tokenize", {"prompt": "the quiet king"}, tenant="a")[0] == 200  # others are not held
    finally:
        held.cancel()
    deadline = time.monotonic() + 10
    while post(stack, "/tokenize", {"prompt": "the quiet king"}, tenant="q")[0] != 200:  # the slot came back
        assert time.monotonic() < deadline, "q's slot was not given back"
        time.sleep(0.1)
    assert post(stack, "/tokenize", {"prompt": BIG}, tenant="q")[0] == 400
    counted = {
        (dict(labels)["operation"], dict(labels)["code"], dict(labels)["tenant"]): value
        for (name, labels), value in scrape_metrics(stack.metrics_port).items()
        if name == "loraserve_gateway_tokenizer_requests_total"
    }
    assert counted[("tokenize", "OK", "q")] >= 2 and counted[("tokenize", "RESOURCE_EXHAUSTED", "q")] >= 2
    assert counted[("detokenize", "RESOURCE_EXHAUSTED", "q")] >= 1
    assert counted[("tokenize", "INVALID_ARGUMENT", "q")] >= 1 and counted[("tokenize", "OK", "a")] >= 1


def test_refused_choices_leave_no_generator_errors_in_the_gateway_log(stack, capfd):
    """Tenant r may run 2 generations: a request of 3 choices is refused 429, again and again."""
    body = {"model": "model", "prompt": "the quiet king", "max_tokens": 200, "ignore_eos": True, "n": 3}
    for round_ in range(40):
        status, answer, _ = post(stack, "/v1/completions", body | {"stream": bool(round_ % 2)}, tenant="r")
        assert status == 429, answer
    time.sleep(1.0)
    output = capfd.readouterr().err
    assert "already running" not in output and "Task was destroyed" not in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
