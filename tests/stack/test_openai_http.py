"""The OpenAI-compatible HTTP API end to end: a real stack with an auth file, the official `openai`
client, and raw HTTP (stdlib `http.client`) where the framing itself is under test.

One stack serves the module: tenants `a` and `b` (own adapters), `q` (one generation at a time).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import importlib.metadata
import io
import json
import re
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
import torch
from certs import CertificateAuthority
from helpers import hf_sequence_logits
from readme import python_example
from stack import LocalStack, free_port_block, scrape_metrics

from loraserve.client import ApiError, Client
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.demo.styles import shows_style
from loraserve.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow
KEYS = {name: f"key-of-{name}-0123456789" for name in ("a", "b", "q")}
TENANTS = {"a": "", "b": "", "q": "max_concurrent = 1"}
BASE = DEMO_MODEL_DIR.name  # the base model's id
PROMPT = "the quiet king"
README_HTTP_ADDRESS = "127.0.0.1:8000"
DEMO_ADAPTERS = demo_adapters()["upper"].parent


@pytest.fixture(scope="module")
def stack(tmp_path_factory, collector):
    auth = tmp_path_factory.mktemp("auth") / "auth.toml"
    auth.write_text(
        "".join(
            f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{hashlib.sha256(KEYS[name].encode()).hexdigest()}"]\n'
            f'scopes = ["adapters"]\n{quota}\n\n'
            for name, quota in TENANTS.items()
        )
    )
    http_port, metrics_port = free_port_block(1), free_port_block(4)
    stack = LocalStack(
        DEMO_MODEL_DIR,
        workers=1,
        collector=collector,
        auth_file=str(auth),
        http_bind=f"127.0.0.1:{http_port}",
        metrics_port=metrics_port,
        adapter_root=str(DEMO_ADAPTERS),  # /v1/load_lora_adapter reads below it
        tool_call_parser="hermes",
    )
    stack.http_port, stack.metrics_port = http_port, metrics_port
    stack.start()
    stack.wait_workers(1)
    upload(stack, "b", "mine", "rot13")
    yield stack
    stack.stop()


def upload(stack, tenant: str, name: str, demo: str) -> None:
    """`tenant` uploads demo adapter `demo` as its own adapter `name` (gRPC: HTTP has no adapter admin)."""
    path = demo_adapters()[demo]
    messages = [gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name=name))] + [
        gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file=f, data=(path / f).read_bytes()))
        for f in ("adapter_config.json", "adapter_model.safetensors")
    ]
    stack.api.UploadAdapter(iter(messages), timeout=60, metadata=(("authorization", f"Bearer {KEYS[tenant]}"),))


def client(stack, tenant: str = "a", key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=key or KEYS[tenant], max_retries=0, timeout=60
    )


def grpc_generate(stack, adapter: str, **fields) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(adapter=adapter, **fields)
    return stack.api.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {KEYS['a']}"),))


def post(stack, path: str, body: dict, key: str | None = KEYS["a"]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    return conn.getresponse()


def sse_events(response: http.client.HTTPResponse) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing: every event one `data: ` line, then a blank one."""
    body = response.read().decode()
    assert body.endswith("\n\n"), body[-200:]
    events = body[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event.removeprefix("data: ") for event in events]


def test_models_lists_the_base_model_and_the_adapters_each_tenant_may_use(stack):
    seen_by_a = {m.id: m.owned_by for m in client(stack, "a").models.list()}
    seen_by_b = {m.id: m.owned_by for m in client(stack, "b").models.list()}
    assert {BASE, "upper", "rot13"} <= set(seen_by_a) and "mine" not in seen_by_a
    assert seen_by_b["mine"] == "b" and set(seen_by_b) == set(seen_by_a) | {"mine"}
    assert client(stack, "b").models.retrieve("mine").id == "mine"
    with pytest.raises(openai.NotFoundError):
        client(stack, "a").models.retrieve("mine")  # another tenant's adapter is as unknown as a missing one


def test_greedy_output_is_the_grpc_apis_for_completions_and_chat(stack):
    for adapter in ("upper", "rot13", ""):
        expected = grpc_generate(stack, adapter, text=PROMPT, max_new_tokens=16)
        model = adapter or BASE
        completion = client(stack).completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
        assert completion.choices[0].text == expected.text
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.prompt_tokens == expected.usage.prompt_tokens
        assert completion.usage.completion_tokens == 16 and completion.usage.total_tokens == 16 + 4
        # the demo template turns one user message into that same prompt (BOS + text)
        chat = client(stack).chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0
        )
        assert chat.choices[0].message.content == expected.text and chat.choices[0].message.role == "assistant"
        assert chat.usage.prompt_tokens == expected.usage.prompt_tokens


def test_sampling_parameters_and_stop_sequences_reach_the_engine(stack):
    def sampled(seed: int) -> str:
        reply = client(stack).completions.create(
            model="upper", prompt=PROMPT, max_tokens=12, temperature=1.5, top_p=0.9, seed=seed, presence_penalty=0.5
        )
        return reply.choices[0].text

    assert sampled(7) == sampled(7)
    assert len({sampled(seed) for seed in range(4)}) > 1
    greedy = grpc_generate(stack, "upper", text=PROMPT, max_new_tokens=16).text
    stop = greedy.strip().split()[2]
    reply = client(stack).completions.create(model="upper", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert reply.choices[0].finish_reason == "stop" and stop not in reply.choices[0].text
    assert greedy.startswith(reply.choices[0].text)
    ids = stack.api.Tokenize(
        gateway_pb2.TokenizeRequest(text=PROMPT, add_special_tokens=True),
        timeout=5,
        metadata=(("authorization", f"Bearer {KEYS['a']}"),),
    ).ids
    by_ids = client(stack).completions.create(model="upper", prompt=list(ids), max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == greedy


def test_streams_with_the_client_add_up_to_the_whole_answer(stack):
    expected = grpc_generate(stack, "rot13", text=PROMPT, max_new_tokens=12)
    stream = client(stack).chat.completions.create(
        model="rot13",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    pieces = client(stack).completions.create(model="rot13", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == expected.text


def test_continuous_usage_stats_report_every_chunks_usage_so_far(stack):
    """guidellm's stream options (include_usage and continuous_usage_stats): every chunk's usage counts the
    prompt and the tokens so far, rising to the last chunk's total, streamed completions and chat alike."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ):
        body |= {"model": "upper", "max_tokens": 10, "temperature": 0, "stream": True, "stream_options": options}
        chunks = [json.loads(e) for e in sse_events(post(stack, path, body))[:-1]]
        total = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and total["completion_tokens"] == 10, total
        generated = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
        assert generated == sorted(generated) and generated[-1] == 10, generated
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {total["prompt_tokens"]}
        assert all(
            c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
            for c, n in zip(chunks[:-1], generated, strict=True)
        )
        if "messages" in body:
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and generated[0] == 0


def test_raw_sse_framing(stack):
    body = {"model": "upper", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    response = post(stack, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 6,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},  # a 4-token prompt fills no page: nothing to cache
    }
    plain = [json.loads(e) for e in sse_events(post(stack, "/v1/completions", body))[:-1]]
    assert "usage" not in plain[-1] and plain[-1]["choices"][0]["finish_reason"] == "length"
    chat_body = {"model": "upper", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}
    chat = sse_events(post(stack, "/v1/chat/completions", chat_body))
    assert chat[-1] == "[DONE]" and json.loads(chat[0])["object"] == "chat.completion.chunk"


def test_http_requests_are_traced_like_grpc_ones_and_join_the_callers_trace(stack, collector):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    reply = client(stack).completions.create(
        model="upper",
        prompt=PROMPT,
        max_tokens=4,
        user="end-user-42",  # OpenAI's end-user id: on the trace, for who looks for a user's requests
        extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    deadline = time.monotonic() + 15
    while True:
        spans = collector.traces().get(trace_id, [])
        services = {s["service"] for s in spans}
        if {"loraserve-gateway", "loraserve-scheduler", "loraserve-worker"} <= services:
            break
        assert time.monotonic() < deadline, f"the request's trace has spans of {services} only"
        time.sleep(0.3)
    (generate,) = [s for s in spans if s["name"] == "gateway.generate"]
    assert generate["attributes"]["loraserve.client_request_id"] == reply.id  # the OpenAI id, on loraserve's trace
    assert generate["attributes"]["loraserve.tenant"] == "a" and generate["attributes"]["loraserve.adapter"] == "upper"
    assert generate["attributes"]["loraserve.end_user"] == "end-user-42"
    grpc_trace = "6bf92f3577b34da6a3ce929d0e0e4736"  # the gRPC API's spelling: metadata
    metadata = (
        *_auth("a"),
        ("x-loraserve-end-user", "end-user-7"),
        ("traceparent", f"00-{grpc_trace}-00f067aa0ba902b7-01"),
    )
    stack.api.Generate(gateway_pb2.GenerateRequest(text=PROMPT, max_new_tokens=2), timeout=60, metadata=metadata)
    while not (found := [s for s in collector.traces().get(grpc_trace, []) if s["name"] == "gateway.generate"]):
        assert time.monotonic() < deadline + 15, "no gateway.generate span on the gRPC request's trace"
        time.sleep(0.3)
    assert found[0]["attributes"]["loraserve.end_user"] == "end-user-7"


def test_errors_have_openais_shape_and_status(stack):
    with pytest.raises(openai.AuthenticationError):
        client(stack, key="not-a-key").models.list()
    response = post(stack, "/v1/completions", {"model": 1}, key=None)  # no key: refused before the body is looked at
    assert response.status == 401
    error = json.loads(response.read())["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"

    with pytest.raises(openai.NotFoundError) as info:
        client(stack).completions.create(model="no-such-adapter", prompt=PROMPT)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client(stack, "a").completions.create(model="mine", prompt=PROMPT)  # b's adapter
    for fields, param in [
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"stop": ["x"] * 9}, "stop"),
        ({"seed": -1}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": ["one"] * 65}, "prompt"),  # more prompts than one request may batch
        ({"prompt": ["one", "x" * 3000]}, "prompt"),  # one bad prompt fails the batch
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 3000}, "prompt"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client(stack).completions.create(**({"model": "upper", "prompt": PROMPT} | fields))
        assert info.value.status_code == 400 and info.value.body["param"] == param, (fields, info.value.body)
        assert info.value.body["type"] == "invalid_request_error" and param in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).chat.completions.create(model="upper", messages=[{"role": "user", "content": "x" * 3000}])
    assert info.value.body["param"] == "messages"
    response = post(stack, "/v1/chat/completions", {"model": "upper", "messages": "hi"})
    assert response.status == 400 and json.loads(response.read())["error"]["param"] == "messages"
    response = post(stack, "/v1/nothing", {})
    assert response.status == 404 and "error" in json.loads(response.read())


def test_over_quota_is_429_with_retry_after(stack):
    slow = post(
        stack,
        "/v1/completions",
        {"model": "upper", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True},
        KEYS["q"],
    )
    assert slow.status == 200 and slow.readline().startswith(b"data: ")  # q's one slot is taken
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client(stack, "q").completions.create(model="upper", prompt=PROMPT, max_tokens=4)
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["code"] == "rate_limit_exceeded"
        assert client(stack, "a").completions.create(model="upper", prompt=PROMPT, max_tokens=4).choices[0].text
    finally:
        slow.close()


def _cancelled(stack) -> float:
    return scrape_metrics(stack.metrics_port).get(
        ("loraserve_gateway_requests_total", (("code", "CANCELLED"), ("tenant", "a"))), 0
    )


def _settles_idle(stack, timeout_s: float = 10.0) -> None:
    """The worker has no request left, and runs no more steps: the generation was cancelled downstream."""
    deadline = time.monotonic() + timeout_s
    while True:
        (worker,) = stack.cluster().workers
        if worker.running == 0 and worker.waiting == 0:
            steps = worker.steps
            time.sleep(0.5)
            if stack.cluster().workers[0].steps == steps:
                return
        assert time.monotonic() < deadline, "the worker still generates after the client left"
        time.sleep(0.1)


def _running(stack, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.cluster().workers[0].running == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_generation(stack, stream):
    """The observable: the gateway counts the request CANCELLED, and the worker stops stepping long before
    the 480 tokens asked for (one engine step per token of a lone request)."""
    _settles_idle(stack)
    cancelled, steps = _cancelled(stack), stack.cluster().workers[0].steps
    body = {"model": "upper", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": stream}
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    headers = {"Authorization": f"Bearer {KEYS['a']}"}  # and no Content-Type: JSON all the same
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    if stream:
        assert conn.getresponse().readline().startswith(b"data: ")
    _running(stack)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    _settles_idle(stack)
    assert stack.cluster().workers[0].steps - steps < 240
    deadline = time.monotonic() + 5
    while _cancelled(stack) != cancelled + 1:
        assert time.monotonic() < deadline, "the gateway did not count a cancelled request"
        time.sleep(0.1)
    assert scrape_metrics(stack.metrics_port)[("loraserve_gateway_requests_in_flight", ())] == 0


def test_concurrent_streams_over_http_and_grpc_agree(stack):
    expected = grpc_generate(stack, "title", text=PROMPT, max_new_tokens=10).text
    results: list[str] = []

    def one() -> None:
        reply = client(stack).completions.create(model="title", prompt=PROMPT, max_tokens=10, temperature=0)
        results.append(reply.choices[0].text)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    grpc_again = grpc_generate(stack, "title", text=PROMPT, max_new_tokens=10).text
    for t in threads:
        t.join(60)
    assert results == [expected] * 4 and grpc_again == expected


def test_readme_openai_example_runs(stack):
    code = python_example("OpenAI(").replace(README_HTTP_ADDRESS, f"127.0.0.1:{stack.http_port}")
    code = code.replace('api_key="unused"', f'api_key="{KEYS["a"]}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    models, completion, chat = out.getvalue().splitlines()
    assert "upper" in models and BASE in models
    assert shows_style("upper", completion), completion
    assert shows_style("rot13", chat), chat


def test_grpc_still_answers_beside_http(stack):
    reply = grpc_generate(stack, "upper", text=PROMPT, max_new_tokens=4, sampling=common_pb2.SamplingParameters())
    assert reply.usage.completion_tokens == 4
    with pytest.raises(grpc.RpcError):
        stack.api.Generate(gateway_pb2.GenerateRequest(adapter="upper", text=PROMPT), timeout=5)


@pytest.fixture
def lone_gateway(tmp_path):
    """`start(*flags)`: a gateway process alone (no scheduler, no store behind it), its HTTP port and log."""
    processes: list[subprocess.Popen] = []

    def start(*flags: str, http_host: str = "127.0.0.1") -> tuple[subprocess.Popen, int, Path]:
        base = free_port_block(5)
        command = [sys.executable, "-m", "loraserve.cli", "gateway", "--bind", f"127.0.0.1:{base}"]
        command += ["--scheduler", f"127.0.0.1:{base + 1}", "--store", f"127.0.0.1:{base + 2}"]
        command += ["--token-address", f"tcp://127.0.0.1:{base + 3}", "--http-bind", f"{http_host}:{base + 4}"]
        log = tmp_path / f"gateway-{len(processes)}.log"
        with log.open("w") as output:
            processes.append(subprocess.Popen([*command, *flags], stdout=output, stderr=subprocess.STDOUT))
        return processes[-1], base + 4, log

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=30)


def _wait_listening(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        assert process.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, "the gateway's HTTP port did not open"
        time.sleep(0.1)


def test_https_uses_the_gateways_tls_files_and_no_scheduler_is_503(lone_gateway, tmp_path):
    ca = CertificateAuthority(tmp_path, "good")
    server, user = ca.server("server"), ca.client("client")
    tls = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca", str(ca.cert)]
    process, port, log = lone_gateway(*tls, "--scheduler-grace", "0.5")
    _wait_listening(process, port, log)
    context = ssl.create_default_context(cafile=str(ca.cert))
    context.load_cert_chain(str(user.cert), str(user.key))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": BASE, "prompt": PROMPT, "max_tokens": 4}))
    response = conn.getresponse()
    body = json.loads(response.read())
    assert response.status == 503 and body["error"]["type"] == "service_unavailable_error", body
    anonymous = ssl.create_default_context(cafile=str(ca.cert))  # no client certificate: mutual TLS refuses
    with pytest.raises((ssl.SSLError, ConnectionError)):
        refused = http.client.HTTPSConnection("127.0.0.1", port, context=anonymous, timeout=10)
        refused.request("GET", "/v1/models")
        refused.getresponse()
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # plaintext on the TLS port
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        plain.request("GET", "/v1/models")
        plain.getresponse().read()


def test_a_public_http_bind_needs_an_auth_file(lone_gateway):
    process, port, log = lone_gateway(http_host="0.0.0.0")
    assert process.wait(timeout=60) == 1
    (line,) = [line for line in log.read_text().splitlines() if "refusing to serve" in line]
    assert f"0.0.0.0:{port}" in line and "--auth-file" in line


def test_up_with_http_bind_prints_examples_that_work(tmp_path):
    """`make run`: `up --show-demo --http-bind` prints a curl and an openai example; the latter runs as printed."""
    base, http_port = free_port_block(6), free_port_block(1)
    address = f"127.0.0.1:{http_port}"
    command = [sys.executable, "-m", "loraserve.cli", "up", "--show-demo", "--base-port", str(base)]
    command += ["--bind", f"127.0.0.1:{free_port_block(1)}", "--http-bind", address, "--data-dir", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        for line in process.stdout:
            lines.append(line)
            if "Ctrl-C stops every process" in line or time.monotonic() > deadline:
                break
        output = "".join(lines)
        assert f"OpenAI-compatible HTTP API on http://{address}/v1" in output, output[-3000:]
        assert f"curl http://{address}/v1/completions" in output
        start = next(i for i, line in enumerate(lines) if "from openai import OpenAI" in line)
        end = next(i for i, line in enumerate(lines) if i > start and "print(" in line)
        example = textwrap.dedent("".join(lines[start : end + 1]))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(example, "up's example", "exec"), {"__name__": "up_example"})
        assert shows_style("rot13", printed.getvalue()), printed.getvalue()
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0


def get(port: int, path: str, key: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    response = conn.getresponse()
    return response.status, response.read()


def test_health_and_version_answer_without_a_key(stack, lone_gateway):
    assert get(stack.http_port, "/health") == (200, b"")  # a worker is ready
    status, body = get(stack.http_port, "/version")
    assert status == 200 and json.loads(body)["version"] == importlib.metadata.version("loraserve")
    info = stack.api.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10, metadata=_auth("a"))
    assert info.server_version == json.loads(body)["version"]  # the gRPC API's /version
    assert get(stack.http_port, "/v1/models")[0] == 401  # the other routes still want a key
    process, port, log = lone_gateway()  # no scheduler behind it: no worker is ready
    _wait_listening(process, port, log)
    status, body = get(port, "/health")
    assert status == 503 and json.loads(body)["error"]["message"] == "no worker is ready"


def test_models_report_the_context_length(stack):
    models = {m["id"]: m for m in json.loads(get(stack.http_port, "/v1/models", KEYS["a"])[1])["data"]}
    info = stack.api.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10, metadata=_auth("a"))
    assert {m["max_model_len"] for m in models.values()} == {info.max_context_length} and info.max_context_length > 0


def test_tokenize_and_detokenize_in_vllms_shapes(stack):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)  # an independent reader of the tokenizer files
    answer = json.loads(
        post(stack, "/tokenize", {"model": "upper", "prompt": PROMPT, "return_token_strs": True}).read()
    )
    ids = reference(PROMPT).input_ids
    assert answer["tokens"] == ids and answer["count"] == len(ids) and answer["max_model_len"] > 0
    assert answer["token_strs"] == reference.convert_ids_to_tokens(ids)
    bare = json.loads(post(stack, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).read())
    assert bare["tokens"] == reference(PROMPT, add_special_tokens=False).input_ids and bare["token_strs"] is None
    messages = [{"role": "user", "content": PROMPT}]
    chat = json.loads(post(stack, "/tokenize", {"model": BASE, "messages": messages}).read())
    usage = client(stack).chat.completions.create(model=BASE, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens  # what a chat completion's prompt is
    detokenized = json.loads(post(stack, "/detokenize", {"tokens": bare["tokens"]}).read())
    assert detokenized["prompt"] == reference.decode(bare["tokens"])
    with Client(stack.address, api_key=KEYS["a"]) as grpc_client:  # the gRPC API's /detokenize
        assert grpc_client.detokenize(answer["tokens"]) == reference.decode(answer["tokens"])  # "<s>" kept
        assert grpc_client.detokenize(answer["tokens"], skip_special_tokens=True) == reference.decode(ids[1:])
        with pytest.raises(ApiError) as refused:
            grpc_client.detokenize([1, 10**6])
        assert refused.value.code == "INVALID_ARGUMENT" and refused.value.details.startswith("ids: ")
    for path, body, status, param in (
        ("/tokenize", {"prompt": PROMPT, "messages": messages}, 400, "prompt"),
        ("/tokenize", {"model": "mine", "prompt": PROMPT}, 404, "model"),  # tenant b's adapter
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ):
        response = post(stack, path, body)
        error = json.loads(response.read())["error"]
        assert (response.status, error["param"]) == (status, param), error
    assert post(stack, "/tokenize", {"prompt": PROMPT}, key=None).status == 401


def _auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def test_every_accepted_parameter_takes_effect_or_is_refused(stack):
    completions = "/v1/completions"
    base = {"model": "upper", "prompt": PROMPT, "max_tokens": 8}
    for extra, param in (
        ({"top_p": 0}, "top_p"),  # not read as 1 (the gRPC API's unset)
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 5}, "min_p"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 2, "n": 2, "best_of": 1}, "best_of"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),  # named as sent, not as `stop`
        ({"use_beam_search": True}, "use_beam_search"),
        ({"add_special_tokens": False}, "add_special_tokens"),
        ({"stream": True, "stream_options": {"include_usage": True, "every_token": True}}, "stream_options"),
    ):
        response = post(stack, completions, base | extra)
        error = json.loads(response.read())["error"]
        assert (response.status, error["param"]) == (400, param), (extra, error)
    chat = {"model": "upper", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    for extra, param in (({"echo": True}, "echo"), ({"function_call": "auto"}, "function_call")):
        response = post(stack, "/v1/chat/completions", chat | extra)
        error = json.loads(response.read())["error"]
        assert (response.status, error["param"]) == (400, param), (extra, error)
    asks_for_nothing = {"use_beam_search": False, "min_tokens": 0, "add_special_tokens": True, "logit_bias": {}}
    assert post(stack, completions, base | asks_for_nothing).status == 200  # vLLM's defaults, spelled out

    def text(**fields) -> str:
        reply = client(stack).completions.create(**base, temperature=1.2, seed=3, extra_body=fields)
        return reply.choices[0].text

    assert text(top_k=-1) == text(top_k=0) != text(top_k=1)  # -1 is vLLM's "off"
    greedy8 = grpc_generate(stack, "upper", text=PROMPT, max_new_tokens=8).text
    assert text(min_p=1.0) == greedy8 != text(min_p=0.0)  # min_p 1 keeps only the most likely token

    whole = client(stack).completions.create(model="upper", prompt=PROMPT, max_tokens=64, temperature=0)
    assert whole.choices[0].finish_reason == "stop"  # the model ended its sentence: EOS
    kept = client(stack).completions.create(
        model="upper", prompt=PROMPT, max_tokens=64, temperature=0, extra_body={"skip_special_tokens": False}
    )
    assert kept.choices[0].text == whole.choices[0].text + "</s>"
    stop = whole.choices[0].text[5:8]
    for include in (False, True):
        cut = client(stack).completions.create(
            model="upper",
            prompt=PROMPT,
            max_tokens=64,
            temperature=0,
            stop=[stop],
            extra_body={"include_stop_str_in_output": include},
        )
        expected = whole.choices[0].text[: whole.choices[0].text.index(stop) + (len(stop) if include else 0)]
        assert cut.choices[0].text == expected, include

    greedy = grpc_generate(stack, "upper", text=PROMPT, max_new_tokens=16)
    stop_id = greedy.token_ids[2]  # a token the greedy answer produces third
    stopped = client(stack).completions.create(
        model="upper", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    first = list(greedy.token_ids).index(stop_id)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == first + 1
    assert greedy.text.startswith(stopped.choices[0].text)


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(stack):
    info = stack.api.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10, metadata=_auth("a"))
    reply = client(stack).chat.completions.create(
        model="upper", messages=[{"role": "user", "content": PROMPT}], extra_body={"ignore_eos": True}
    )
    usage = reply.usage
    assert usage.prompt_tokens + usage.completion_tokens == info.max_context_length > info.default_max_new_tokens
    assert reply.choices[0].finish_reason == "length"


def test_adapters_load_and_unload_over_http_in_vllms_shapes(stack):
    expected = grpc_generate(stack, "rot13", text=PROMPT, max_new_tokens=8).text
    loaded = post(stack, "/v1/load_lora_adapter", {"lora_name": "disk-rot13", "lora_path": "rot13"})
    assert loaded.status == 200 and loaded.read().decode() == "Success: LoRA adapter 'disk-rot13' added successfully."
    assert "disk-rot13" in {m.id for m in client(stack, "a").models.list()}
    assert "disk-rot13" not in {m.id for m in client(stack, "b").models.list()}  # in tenant a's namespace only
    reply = client(stack).completions.create(model="disk-rot13", prompt=PROMPT, max_tokens=8, temperature=0)
    assert reply.choices[0].text == expected
    for path, body, status, param in (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../rot13"}, 400, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "no-such-dir"}, 404, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "bad/name", "lora_path": "rot13"}, 400, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": "disk-rot13", "lora_int_id": 1}, 400, "lora_int_id"),
        ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name"),
    ):
        response = post(stack, path, body)
        error = json.loads(response.read())["error"]
        assert (response.status, error["param"]) == (status, param), (body, error)
    assert post(stack, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "rot13"}, key=None).status == 401
    unloaded = post(stack, "/v1/unload_lora_adapter", {"lora_name": "disk-rot13"})
    assert unloaded.status == 200 and "removed" in unloaded.read().decode()
    with pytest.raises(openai.NotFoundError):
        client(stack).completions.create(model="disk-rot13", prompt=PROMPT, max_tokens=4)


def test_a_batch_of_prompts_answers_each_in_order(stack):
    prompts = ["the quiet king", "a small river", "the old road", "bright stars"]
    single = [grpc_generate(stack, "upper", text=p, max_new_tokens=8) for p in prompts]
    reply = client(stack).completions.create(model="upper", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in reply.choices] == list(range(len(prompts)))
    assert [c.text for c in reply.choices] == [r.text for r in single]
    assert reply.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in single)
    assert reply.usage.completion_tokens == sum(r.usage.completion_tokens for r in single)
    tokenize = gateway_pb2.TokenizeRequest
    ids = [
        list(stack.api.Tokenize(tokenize(text=p, add_special_tokens=True), metadata=_auth("a")).ids) for p in prompts
    ]
    by_ids = client(stack).completions.create(model="upper", prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [r.text for r in single]  # token-id prompts batch the same way

    body = {"model": "upper", "prompt": prompts, "max_tokens": 8, "temperature": 0, "stream": True}
    events = sse_events(post(stack, "/v1/completions", body | {"stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finishes = [""] * len(prompts), [[] for _ in prompts]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert texts == [r.text for r in single] and all(len(f) == 1 for f in finishes)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == reply.usage.completion_tokens


def _answered(stack, path: str, body: dict) -> dict[int, tuple[str, list, str]]:
    """Each choice of the answer to `body` (whole, or joined from its stream): (text, log-probability
    tokens, finish reason); a stream's chat choices must each open with the assistant's role."""
    chat = path.endswith("chat/completions")
    response = post(stack, path, body)
    assert response.status == 200, response.read()
    if not body.get("stream"):
        out = {}
        for c in json.loads(response.read())["choices"]:
            logprobs = c["logprobs"] or {}
            tokens = [e["token"] for e in logprobs.get("content", [])] if chat else logprobs.get("tokens", [])
            out[c["index"]] = (c["message"]["content"] if chat else c["text"], tokens, c["finish_reason"])
        return out
    texts, tokens, reasons, roles = {}, {}, {}, {}
    for event in sse_events(response)[:-1]:
        for c in json.loads(event)["choices"]:
            i = c["index"]
            part = c["delta"] if chat else {"content": c["text"]}
            texts[i] = texts.get(i, "") + (part.get("content") or "")
            roles[i] = roles.get(i, 0) + ("role" in part)
            logprobs = c["logprobs"] or {}
            tokens[i] = tokens.get(i, []) + (
                [e["token"] for e in logprobs.get("content", [])] if chat else logprobs.get("tokens", [])
            )
            reasons[i] = c["finish_reason"] or reasons.get(i)
    assert not chat or set(roles.values()) == {1}, roles
    return {i: (texts[i], tokens[i], reasons[i]) for i in texts}


def test_a_stream_answers_what_the_whole_answer_does(stack):
    greedy = grpc_generate(stack, "upper", text=PROMPT, max_new_tokens=4).text
    bodies = [
        (  # a batch of two choices each, echoed with log-probabilities
            "/v1/completions",
            {"prompt": [PROMPT, "a small river"], "n": 2, "echo": True, "logprobs": 1, "temperature": 1.0, "seed": 4},
        ),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "stop": [greedy[:2]], "temperature": 0}),  # no text
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": PROMPT}], "n": 3, "logprobs": True, "top_logprobs": 1, "seed": 2},
        ),
    ]
    answers = []
    for path, fields in bodies:
        body = {"model": "upper", "max_tokens": 5} | fields
        whole = _answered(stack, path, body)
        assert whole == _answered(stack, path, body | {"stream": True}), body
        prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
        assert sorted(whole) == list(range(body.get("n", 1) * prompts))
        answers.append(whole)
    echoed, tokens, _ = answers[0][2]  # the second prompt's first choice: its text and tokens begin with it
    assert echoed.startswith("a small river") and "".join(tokens[1:]).startswith("a small river") and tokens[0] == "<s>"
    assert answers[1] == {0: (PROMPT, [], "stop")}  # stopped before any text: the echo alone


def test_logprobs_and_echo_are_peft_s_through_grpc_and_http(stack):
    """gRPC against transformers + peft, then completions (echo, a stream) and chat against gRPC."""
    sampling = common_pb2.SamplingParameters(logprobs=3, prompt_logprobs=3)
    scored = grpc_generate(stack, "upper", text=PROMPT, max_new_tokens=4, sampling=sampling)
    prompt_ids = [e.token_id for e in scored.prompt_logprobs]
    assert not scored.prompt_logprobs[0].HasField("logprob") and len(scored.logprobs) == len(scored.token_ids) == 4
    reference = torch.log_softmax(
        hf_sequence_logits(DEMO_MODEL_DIR, demo_adapters()["upper"], prompt_ids + list(scored.token_ids)), -1
    )
    entries = [*scored.prompt_logprobs[1:], *scored.logprobs]
    for position, entry in enumerate(entries):  # row i predicts token i + 1
        assert entry.logprob == pytest.approx(reference[position, entry.token_id].item(), abs=1e-4)
        assert [t.logprob for t in entry.top] == pytest.approx(reference[position].topk(3).values.tolist(), abs=1e-4)
    assert [e.token_id for e in scored.logprobs] == list(scored.token_ids)

    # lm-evaluation-harness's loglikelihood request (greedy, as it sends it)
    reply = post(
        stack,
        "/v1/completions",
        {"model": "upper", "prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0},
    )
    assert reply.status == 200
    choice = json.loads(reply.read())["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["logprobs"]["tokens"]) == len(prompt_ids) + 1
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([e.logprob for e in entries[: len(prompt_ids)]])
    # OpenAI's older scoring request (lm-eval's openai-completions, HELM): max_tokens 0, the prompt alone
    body = {"model": "upper", "prompt": [PROMPT, PROMPT], "max_tokens": 0, "logprobs": 1, "echo": True}
    scored_only = json.loads(post(stack, "/v1/completions", body).read())
    for only in scored_only["choices"]:
        assert (only["text"], only["finish_reason"]) == (PROMPT, "length")
        assert only["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"][:-1]
    assert scored_only["usage"]["completion_tokens"] == 0
    streamed_only = sse_events(post(stack, "/v1/completions", body | {"stream": True}))
    assert "".join(json.loads(e)["choices"][0]["text"] for e in streamed_only[:-1]) == PROMPT * 2

    completion = client(stack).completions.create(
        model="upper", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, echo=True
    )
    logprobs = completion.choices[0].logprobs
    assert completion.choices[0].text == PROMPT + scored.text
    assert logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in entries])
    listed = zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True)
    for token, logprob, top in listed:
        assert len(top) <= 4 and top[token] == logprob  # the 3 likeliest and the token's own, as OpenAI answers
    text = completion.choices[0].text  # each token's text begins where its offset says (BOS is not in the text)
    assert logprobs.tokens[0] == "<s>" and logprobs.text_offset[:2] == [0, 0]
    assert all(text.startswith(t, o) for t, o in zip(logprobs.tokens[1:], logprobs.text_offset[1:], strict=True))
    streamed = client(stack).completions.create(
        model="upper", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, echo=True, stream=True
    )
    chunks = [c.choices[0] for c in streamed]
    assert "".join(c.text for c in chunks) == completion.choices[0].text
    assert [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs] == logprobs.token_logprobs
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == logprobs.text_offset

    chat = client(stack).chat.completions.create(
        model="upper",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in scored.logprobs])
    assert all(len(c.top_logprobs) == 2 and bytes(c.bytes).decode() == c.token for c in content)
    plain = client(stack).chat.completions.create(
        model="upper", messages=[{"role": "user", "content": PROMPT}], max_tokens=2
    )
    assert plain.choices[0].logprobs is None


def test_langchain_openai_batches_and_reads_logprobs(stack):
    """langchain-openai's completion model batches prompts into one request (a list of prompts);
    its chat model reads the log-probabilities it asks for."""
    from langchain_openai import ChatOpenAI, OpenAI

    common = {"base_url": f"http://127.0.0.1:{stack.http_port}/v1", "api_key": KEYS["a"], "max_retries": 0}
    prompts = ["the quiet king", "a small river", "the old road"]
    expected = [grpc_generate(stack, "upper", text=p, max_new_tokens=8).text for p in prompts]
    llm = OpenAI(model="upper", temperature=0, max_tokens=8, batch_size=3, **common)
    assert llm.batch(prompts) == expected
    assert [g[0].text for g in llm.generate(prompts).generations] == expected
    chat = ChatOpenAI(model="upper", temperature=0, max_tokens=8, logprobs=True, top_logprobs=2, **common)
    reply = chat.invoke([("user", PROMPT)])
    assert reply.content == expected[0]
    content = reply.response_metadata["logprobs"]["content"]
    assert len(content) == reply.usage_metadata["output_tokens"] and all(len(c["top_logprobs"]) == 2 for c in content)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["calm", "stormy"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}


def test_structured_output_through_grpc_and_http_is_one_constraint(stack):
    """Each kind over gRPC; each HTTP spelling gives the gRPC answer (greedy), whole and streamed."""
    kinds = {
        "json_schema": (
            common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
            lambda t: jsonschema.validate(json.loads(t), SCHEMA),
        ),
        "regex": (
            common_pb2.StructuredOutput(regex=r"[a-z]{2,5}( [a-z]{2,5}){1,3}\."),
            lambda t: re.fullmatch(r"[a-z]{2,5}( [a-z]{2,5}){1,3}\.", t) or pytest.fail(t),
        ),
        "choice": (
            common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=["calm", "stormy"])),
            lambda t: t in ("calm", "stormy") or pytest.fail(t),
        ),
        "grammar": (
            common_pb2.StructuredOutput(grammar='start: "n=" /[1-9][0-9]?/'),
            lambda t: re.fullmatch("n=[1-9][0-9]?", t) or pytest.fail(t),
        ),
    }
    grpc_texts = {}
    for kind, (constraint, valid) in kinds.items():
        for adapter in ("", "upper", "reverse"):
            reply = grpc_generate(
                stack,
                adapter,
                text=PROMPT,
                max_new_tokens=80,
                sampling=common_pb2.SamplingParameters(structured_output=constraint),
            )
            assert reply.finish_reason == common_pb2.FINISH_REASON_STOP, (kind, adapter, reply.text)
            valid(reply.text)
            grpc_texts[kind, adapter] = reply.text

    c = client(stack)
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = c.chat.completions.create(
        model="upper",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=80,
        temperature=0,
        response_format=schema_format,
    )
    assert chat.choices[0].message.content == grpc_texts["json_schema", "upper"]
    spellings = {
        "json_schema": [
            {"guided_json": SCHEMA},
            {"guided_json": json.dumps(SCHEMA)},
            {"structured_outputs": {"json": SCHEMA}},
            {"response_format": schema_format},
        ],
        "regex": [
            {"guided_regex": kinds["regex"][0].regex},
            {"structured_outputs": {"regex": kinds["regex"][0].regex}},
        ],
        "choice": [{"guided_choice": ["calm", "stormy"]}, {"structured_outputs": {"choice": ["calm", "stormy"]}}],
        "grammar": [{"guided_grammar": kinds["grammar"][0].grammar}],
    }
    for kind, bodies in spellings.items():
        for extra in bodies:
            whole = c.completions.create(model="reverse", prompt=PROMPT, max_tokens=80, temperature=0, extra_body=extra)
            assert whole.choices[0].text == grpc_texts[kind, "reverse"], (kind, extra)
            streamed = c.completions.create(
                model="reverse", prompt=PROMPT, max_tokens=80, temperature=0, stream=True, extra_body=extra
            )
            assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == grpc_texts[kind, "reverse"]

    sampled = {
        c.completions.create(
            model="upper", prompt=PROMPT, max_tokens=80, temperature=1.0, seed=s, extra_body={"guided_json": SCHEMA}
        )
        .choices[0]
        .text
        for s in range(4)
    }
    for text in sampled:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(sampled) > 1


def test_structured_output_refusals_name_the_parameter(stack):
    base = {"model": "upper", "prompt": PROMPT, "max_tokens": 8}
    for extra, param, words in (
        ({"guided_json": {"type": "nonsense"}}, "guided_json", "nonsense"),
        ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}},
                }
            },
            "response_format",
            "",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "conflicts"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "structured output"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "llguidance"),
    ):
        response = post(stack, "/v1/completions", base | extra)
        error = json.loads(response.read())["error"]
        assert (response.status, error["param"]) == (400, param), (extra, error)
        assert words in error["message"], error
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(
            stack,
            "upper",
            text=PROMPT,
            sampling=common_pb2.SamplingParameters(structured_output=common_pb2.StructuredOutput(regex="(")),
        )
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.structured_output.regex" in e.value.details()
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def _check_call(call, tools=(WEATHER, TIME)) -> None:
    function = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), function["parameters"])
    assert call.type == "function" and re.fullmatch("call_[0-9a-f]{24}", call.id)


def test_tool_choice_named_and_required_answer_valid_calls(stack):
    c = client(stack)
    messages = [{"role": "user", "content": PROMPT}]
    named = c.chat.completions.create(
        model="upper",
        messages=messages,
        max_tokens=80,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    _check_call(choice.message.tool_calls[0])

    # one call at most, or as many as the model writes (the demo model may go on listing calls until
    # max_tokens: such an answer ends "length", its text given as content, no call guessed from it)
    ended = []
    for parallel, seed in [(False, s) for s in range(3)] + [(True, s) for s in range(6)]:
        required = c.chat.completions.create(
            model="upper",
            messages=messages,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        choice = required.choices[0]
        if choice.finish_reason == "length":
            assert parallel and choice.message.tool_calls is None and choice.message.content.startswith("[")
            continue
        assert choice.finish_reason == "tool_calls", choice
        assert 1 <= len(choice.message.tool_calls) <= (200 if parallel else 1)
        for call in choice.message.tool_calls:
            _check_call(call)
        ended.append((parallel, len(choice.message.tool_calls)))
    assert any(parallel for parallel, _ in ended), ended

    streamed = c.chat.completions.create(
        model="upper",
        messages=messages,
        max_tokens=80,
        temperature=0,
        tools=[WEATHER, TIME],
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    chunks = list(streamed)
    calls = [tc for chunk in chunks for tc in (chunk.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, "get_weather", named.choices[0].message.tool_calls[0].function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "stop"

    # a conversation that carries an earlier call and the tool's answer is taken
    history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
    ]
    auto = c.chat.completions.create(model="upper", messages=history, max_tokens=8, temperature=0, tools=[WEATHER])
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content  # the demo model writes text
    # a strict tool holds auto to the parser's grammar (test_tool_parsers.py), where text runs as it would
    strict = {"type": "function", "function": WEATHER["function"] | {"strict": True}}
    held = c.chat.completions.create(model="upper", messages=history, max_tokens=8, temperature=0, tools=[strict])
    assert held.choices[0].message.content == auto.choices[0].message.content


def test_tool_refusals_name_the_parameter(stack):
    base = {"model": "upper", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    for extra, param in (
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (  # auto with a strict tool is constrained too: one constraint per request
            {
                "tools": [{"type": "function", "function": WEATHER["function"] | {"strict": True}}],
                "guided_regex": "a+",
            },
            "guided_regex",
        ),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),  # the old spelling: refused
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
    ):
        response = post(stack, "/v1/chat/completions", base | extra)
        error = json.loads(response.read())["error"]
        assert (response.status, error["param"]) == (400, param), (extra, error)


def test_langchain_structured_output_in_every_method_and_bound_tools(stack):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, ConfigDict, Field

    class Person(BaseModel):
        """A person in the story."""

        model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas have
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    common = {"base_url": f"http://127.0.0.1:{stack.http_port}/v1", "api_key": KEYS["a"], "max_retries": 0}
    chat = ChatOpenAI(model="upper", temperature=0, max_tokens=80, **common)
    for method in ("json_schema", "function_calling"):
        person = chat.with_structured_output(Person, method=method).invoke(PROMPT)
        assert isinstance(person, Person), method
    loose = chat.with_structured_output(None, method="json_mode", include_raw=True).invoke(PROMPT)
    raw = loose["raw"].content
    assert raw.startswith("{") and (
        loose["parsed"] == json.loads(raw) or loose["raw"].response_metadata["finish_reason"] == "length"
    )

    class GetWeather(BaseModel):
        """The weather in a city."""

        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=12)

    @tool
    def get_time(zone: int) -> str:
        """The time in a zone."""
        return "noon"

    for tools, choice in (([GetWeather], "any"), ([GetWeather, get_time], "GetWeather"), ([get_time], "get_time")):
        # strict: closed schemas (additionalProperties: false), so the arguments end
        bound = chat.bind_tools(tools, tool_choice=choice, parallel_tool_calls=False, strict=True)
        reply = bound.invoke(PROMPT)
        name = choice if choice != "any" else "GetWeather"
        assert [call["name"] for call in reply.tool_calls][:1] == [name], (choice, reply)
        assert isinstance(reply.tool_calls[0]["args"]["zone" if name == "get_time" else "city"], int | str)


def _prompt_tokens_not_computed(stack) -> float:
    """Prompt tokens the worker did not compute: copied from a prefill group's first member, or found in
    its prefix cache (which holds the first member's full pages once it has computed them)."""
    worker = scrape_metrics(stack.metrics_port + 3)  # gateway, scheduler, store, then worker-0
    label = (("worker", "worker-0"),)
    return sum(
        worker.get((name, label), 0.0)
        for name in ("loraserve_worker_shared_prefill_tokens_total", "loraserve_worker_prefix_cache_hit_tokens_total")
    )


def test_n_choices_share_their_prompts_prefill_and_best_of_answers_the_likeliest(stack):
    c = client(stack)
    prompt = PROMPT + " and the green queen waits across this gentle tree"
    before = _prompt_tokens_not_computed(stack)
    reply = c.completions.create(model="upper", prompt=prompt, max_tokens=32, temperature=1.0, seed=5, n=3)
    saved = _prompt_tokens_not_computed(stack) - before
    singles = [
        c.completions.create(model="upper", prompt=prompt, max_tokens=32, temperature=1.0, seed=5 + i, logprobs=0)
        for i in range(3)
    ]
    prompt_len = singles[0].usage.prompt_tokens
    assert saved == 2 * (prompt_len - 1)  # computed once for three
    assert [(ch.index, ch.text) for ch in reply.choices] == [(i, s.choices[0].text) for i, s in enumerate(singles)]
    assert len({ch.text for ch in reply.choices}) > 1
    assert reply.usage.prompt_tokens == prompt_len  # the prompt counts once
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)

    best = c.completions.create(model="upper", prompt=prompt, max_tokens=32, temperature=1.0, seed=5, best_of=3)
    likeliest = max(singles, key=lambda s: sum(s.choices[0].logprobs.token_logprobs))
    assert [ch.text for ch in best.choices] == [likeliest.choices[0].text]
    assert best.choices[0].logprobs is None  # ranked by log-probability, which was not asked for
    assert best.usage.completion_tokens == reply.usage.completion_tokens  # every candidate counts

    chat = c.chat.completions.create(
        model="upper", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=1.0, seed=9, n=2
    )
    streamed = c.chat.completions.create(
        model="upper",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=1.0,
        seed=9,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = {0: "", 1: ""}, None
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [ch.message.content for ch in chat.choices]
    assert usage.prompt_tokens == chat.usage.prompt_tokens and usage.completion_tokens == chat.usage.completion_tokens

    # gRPC: n choices are n calls of one prefill group (another salt: not the pages cached above)
    before = _prompt_tokens_not_computed(stack)
    calls = [
        stack.api.Generate.future(
            gateway_pb2.GenerateRequest(
                adapter="upper",
                text=prompt,
                max_new_tokens=32,
                sampling=common_pb2.SamplingParameters(temperature=1.0, seed=5 + i),
                prefill_group="mine",
                cache_salt="grpc",
            ),
            timeout=60,
            metadata=(("authorization", f"Bearer {KEYS['a']}"),),
        )
        for i in range(3)
    ]
    assert [call.result().text for call in calls] == [s.choices[0].text for s in singles]
    assert _prompt_tokens_not_computed(stack) - before == 2 * (prompt_len - 1)


def test_n_and_best_of_refusals_name_the_parameter(stack):
    base = {"model": "upper", "prompt": PROMPT, "max_tokens": 4}
    for extra, param in (
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"prompt": [PROMPT] * 9, "n": 8}, "n"),  # 72 generations
        ({"prompt": [PROMPT] * 9, "best_of": 8}, "best_of"),
    ):
        response = post(stack, "/v1/completions", base | extra)
        error = json.loads(response.read())["error"]
        assert (response.status, error["param"]) == (400, param), (extra, error)


def test_a_tenants_repeated_prefix_is_cached_and_no_other_tenant_sees_it(stack, collector):
    system = " ".join(["the quiet king finds my little boat and the green queen waits across this gentle tree"] * 4)
    prompt = system + " and then"
    a, b = client(stack, "a"), client(stack, "b")
    first = a.completions.create(model=BASE, prompt=prompt, max_tokens=6, temperature=0)
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4736"
    traced = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    again = a.completions.create(model=BASE, prompt=prompt, max_tokens=6, temperature=0, extra_headers=traced)
    prompt_tokens = first.usage.prompt_tokens
    full_pages = (prompt_tokens - 1) // 16 * 16  # the last token is always computed
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == full_pages > 0
    assert again.choices[0].text == first.choices[0].text
    other = b.completions.create(model=BASE, prompt=prompt, max_tokens=6, temperature=0)  # tenant b: a cold miss
    salted = a.completions.create(
        model=BASE, prompt=prompt, max_tokens=6, temperature=0, extra_body={"cache_salt": "u1"}
    )
    assert other.usage.prompt_tokens_details.cached_tokens == 0 == salted.usage.prompt_tokens_details.cached_tokens
    assert other.choices[0].text == salted.choices[0].text == first.choices[0].text
    reply = stack.api.Generate(
        gateway_pb2.GenerateRequest(text=prompt, max_new_tokens=6, cache_salt="u1"),
        timeout=60,
        metadata=(("authorization", f"Bearer {KEYS['a']}"),),
    )
    assert reply.usage.cached_tokens == full_pages and reply.text == first.choices[0].text  # u1's, cached now
    worker = scrape_metrics(stack.metrics_port + 3)
    label = (("worker", "worker-0"),)
    assert worker[("loraserve_worker_prefix_cache_hit_tokens_total", label)] >= 2 * full_pages
    assert worker[("loraserve_worker_prefix_cache_query_tokens_total", label)] > 0
    assert worker[("loraserve_worker_prefix_cache_pages", label)] > 0
    deadline = time.monotonic() + 15  # the latency breakdown shows the prefill that was skipped
    while not (prefill := [x for x in collector.traces().get(trace_id, []) if x["name"] == "worker.prefill"]):
        assert time.monotonic() < deadline, "no worker.prefill span on the request's trace"
        time.sleep(0.3)
    assert prefill[0]["attributes"]["loraserve.cached_tokens"] == full_pages
    assert prefill[0]["attributes"]["loraserve.prompt_tokens"] == prompt_tokens


def test_a_tiny_temperature_is_greedy_over_http_and_grpc(stack):
    """Clients send temperature 1e-4 or 1e-6 meaning greedy (lm-eval, SDK examples): it is answered as
    temperature 0 is, not refused."""
    greedy = client(stack).completions.create(model="upper", prompt=PROMPT, max_tokens=12, temperature=0)
    tiny = client(stack).completions.create(model="upper", prompt=PROMPT, max_tokens=12, temperature=1e-4)
    assert tiny.choices[0].text == greedy.choices[0].text != ""
    sampling = common_pb2.SamplingParameters(temperature=1e-6)
    reply = grpc_generate(stack, "upper", text=PROMPT, max_new_tokens=12, sampling=sampling)
    assert reply.text == greedy.choices[0].text
