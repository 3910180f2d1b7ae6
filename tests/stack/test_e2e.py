"""End to end: the stack as real processes on real sockets, driven by a real gRPC client."""

from __future__ import annotations

import contextlib
import io
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from readme import README_API_ADDRESS, python_example
from stack import LocalStack, free_port_block, scrape_metrics

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.demo.corpus import HELD_OUT_PROMPTS
from loraserve.v1 import common_pb2, gateway_pb2
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.sampling import SamplingParams

pytestmark = pytest.mark.slow
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def stack(collector):
    metrics_port = free_port_block(5)  # gateway, scheduler, adapter store, 2 workers
    stack = LocalStack(DEMO_MODEL_DIR, workers=2, collector=collector, max_batch_size=4, metrics_port=metrics_port)
    stack.metrics_port = metrics_port
    stack.start()
    stack.wait_workers(2)
    yield stack
    stack.stop()


def _generate(stack, timeout=60, **fields):
    return stack.api.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout)


def _stream(stack, timeout=60, **fields):
    """(token ids, text, summary) of a streamed generation."""
    tokens, text, summary = [], "", None
    for event in stack.api.GenerateStream(gateway_pb2.GenerateRequest(**fields), timeout=timeout):
        if event.HasField("chunk"):
            tokens += event.chunk.token_ids
            text += event.chunk.text
        else:
            summary = event.summary
    return tokens, text, summary


def _idle(stack, timeout_s=10.0) -> bool:
    """True once no worker holds a running request or KV pages."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = stack.cluster().workers
        if all(w.running == 0 and w.kv_pages == 0 for w in workers):
            return True
        time.sleep(0.1)
    return False


def test_health_and_reflection_answer(stack):
    health = health_pb2_grpc.HealthStub(stack.channel)
    for service in ("", "loraserve.v1.LoraServe"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = ProtoReflectionDescriptorDatabase(stack.channel).get_services()
    assert "loraserve.v1.LoraServe" in services and "grpc.health.v1.Health" in services
    deadline = time.monotonic() + 5.0  # the gateway asks the scheduler twice a second
    while (info := stack.api.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)).ready_workers < 2:
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    assert info.model_type == "llama" and info.ready_workers == 2


def test_the_readme_api_example_streams_an_uppercase_continuation(stack):
    code = python_example("client.stream(").replace(README_API_ADDRESS, stack.address)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    text, summary = out.getvalue().split("\n", 1)
    assert text.strip() and text == text.upper(), text
    assert summary.split()[0] in ("stop", "length"), summary
    assert "time_to_first_token_s" in summary


def test_prometheus_metrics_count_what_the_stack_did(stack):
    gateway, scheduler, store, *workers = range(stack.metrics_port, stack.metrics_port + 5)
    before = scrape_metrics(gateway)
    ok = ("loraserve_gateway_requests_total", (("code", "OK"), ("tenant", "default")))
    not_found = ("loraserve_gateway_requests_total", (("code", "NOT_FOUND"), ("tenant", "default")))
    reply = _generate(stack, adapter="upper", text="the quiet king", max_new_tokens=8)
    with pytest.raises(grpc.RpcError):
        _generate(stack, adapter="no-such-adapter", text="the quiet king")
    after = scrape_metrics(gateway)
    assert after[ok] - before.get(ok, 0) == 1 and after[not_found] - before.get(not_found, 0) == 1
    tokens = ("loraserve_gateway_output_tokens_total", ())
    assert after[tokens] - before.get(tokens, 0) == len(reply.token_ids)
    ttft = ("loraserve_gateway_time_to_first_token_seconds_count", ())
    assert after[ttft] - before.get(ttft, 0) == 1
    assert after[("loraserve_gateway_requests_in_flight", ())] == 0

    assert scrape_metrics(scheduler)[("loraserve_scheduler_ready_workers", ())] == 2
    assert scrape_metrics(scheduler)[("loraserve_scheduler_assigned_requests_total", ())] >= 1
    assert ("process_cpu_seconds_total", ()) in scrape_metrics(store)
    total_pages = {w.worker_id: w.total_pages for w in stack.cluster().workers}
    served_steps = 0.0
    for port in workers:
        m = scrape_metrics(port)
        (worker,) = {dict(labels)["worker"] for name, labels in m if name == "loraserve_worker_pool_pages"}
        pages = sum(v for (name, _), v in m.items() if name == "loraserve_worker_pool_pages")
        assert pages == total_pages[worker]
        assert m[("loraserve_worker_ready", (("worker", worker),))] == 1
        observed = m[("loraserve_worker_step_seconds_count", (("worker", worker),))]  # serving steps
        assert m[("loraserve_worker_steps_total", (("worker", worker),))] >= observed  # + the warm-up's
        served_steps += observed
    assert served_steps >= len(reply.token_ids)  # one token per decode step at least


def test_concurrent_streams_match_the_offline_engine(stack):
    names = ["", *demo_adapters()]
    prompts = [HELD_OUT_PROMPTS[i % len(HELD_OUT_PROMPTS)] for i in range(len(names))]
    results: dict[str, tuple] = {}

    def run(name, prompt):
        results[name] = _stream(stack, adapter=name, text=prompt, max_new_tokens=NEW_TOKENS)

    threads = [threading.Thread(target=run, args=pair) for pair in zip(names, prompts, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=512))
    for name, path in demo_adapters().items():
        engine.register_adapter(name, path)
    offline = engine.generate(
        [
            GenerateRequest(prompt=p, adapter=n or None, sampling=SamplingParams(max_new_tokens=NEW_TOKENS))
            for n, p in zip(names, prompts, strict=True)
        ]
    )
    for name, expected in zip(names, offline, strict=True):
        tokens, text, summary = results[name]
        assert tokens == expected.token_ids, name
        assert text == expected.text, name
        assert summary.usage.completion_tokens == len(tokens)
        assert summary.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert summary.timings.time_to_first_token_s > 0 and summary.timings.total_s >= summary.timings.decode_s
        assert summary.worker_id.startswith("worker-")


@pytest.mark.parametrize("adapter", ["", "upper"])
def test_a_repeated_prefix_goes_to_the_worker_that_caches_it(stack, adapter):
    """Prefix caching across workers: six prompts at once fill both workers (4 slots each at most);
    asked again one by one, each goes back to the worker that holds its prefix and finds it cached
    there (without prefix-aware placement, idle workers tie and one of them would take them all). An
    adapter's prefixes are keyed by its version's weights, which the scheduler learns from the store."""
    story = "the quiet king finds my little boat and the green queen waits across this gentle tree "
    prompts = [f"{word} {adapter} {story * 3}" for word in ("one", "two", "three", "four", "five", "six")]
    first: dict[int, tuple] = {}
    together = threading.Barrier(len(prompts))  # sent at once, so that they overlap even on a loaded machine

    def run(i):
        together.wait()
        first[i] = _stream(stack, text=prompts[i], adapter=adapter, max_new_tokens=NEW_TOKENS)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    workers = {i: summary.worker_id for i, (_, _, summary) in first.items()}
    assert len(set(workers.values())) == 2, workers
    assert _idle(stack)
    time.sleep(1.5)  # the workers' next reports carry their cached prefixes (every 0.25 s when idle)
    for i, prompt in enumerate(prompts):
        tokens, _, summary = _stream(stack, text=prompt, adapter=adapter, max_new_tokens=NEW_TOKENS)
        assert summary.worker_id == workers[i], (i, summary.worker_id, workers)
        assert summary.usage.cached_tokens >= (summary.usage.prompt_tokens - 1) // 16 * 16 * 2 // 3 > 0
        assert tokens == first[i][0]


def _steps(stack) -> int:
    return sum(w.steps for w in stack.cluster().workers)


def _settled_steps(stack, timeout_s: float = 10.0) -> int:
    """The workers' step count once their reports have caught up with the steps already taken: a
    worker reports its last step just after that step's tokens went out (idle reports every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    steps = _steps(stack)
    while time.monotonic() < deadline:
        time.sleep(0.4)
        if (now := _steps(stack)) == steps:
            return steps
        steps = now
    raise AssertionError("the workers kept stepping")


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        ({"adapter": "no-such-adapter", "text": "the old fox"}, grpc.StatusCode.NOT_FOUND, "no-such-adapter"),
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt: is empty"),
        (
            {"text": "the old fox", "sampling": common_pb2.SamplingParameters(temperature=500)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.temperature",
        ),
        (
            {"text": "the old fox", "sampling": common_pb2.SamplingParameters(top_p=2)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_p",
        ),
        ({"text": "the old fox", "max_new_tokens": 100000}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        ({"text": "the old fox " * 200, "max_new_tokens": 100}, grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    ],
)
def test_bad_requests_get_precise_statuses_and_reach_no_worker(stack, fields, code, message):
    before = _settled_steps(stack)
    with pytest.raises(grpc.RpcError) as info:
        _generate(stack, **fields)
    assert info.value.code() == code
    assert message in info.value.details()
    assert _steps(stack) == before, "an invalid request must not reach a worker"


def test_cancel_mid_stream_frees_the_pages(stack):
    assert _idle(stack)
    call = stack.api.GenerateStream(
        gateway_pb2.GenerateRequest(
            adapter="reverse",
            text="the quiet king",
            max_new_tokens=400,
            sampling=common_pb2.SamplingParameters(ignore_eos=True),
        ),
        timeout=60,
    )
    chunks = 0
    for event in call:
        chunks += event.HasField("chunk")
        if chunks == 3:
            break
    assert any(w.kv_pages > 0 for w in stack.cluster().workers), "the request should hold KV pages while it runs"
    call.cancel()
    assert _idle(stack, 5.0), "cancelling must free the request's pages at the worker's next step"


def test_short_deadline_is_deadline_exceeded(stack):
    request = gateway_pb2.GenerateRequest(
        text="the quiet king", max_new_tokens=400, sampling=common_pb2.SamplingParameters(ignore_eos=True)
    )
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        # 400 tokens take ~0.45 s on an idle 2-core machine: the deadline must fall well inside them
        _stream(stack, timeout=0.1, **{f.name: v for f, v in request.ListFields()})
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 3.0
    assert _idle(stack, 5.0)


def _upload(stack, name: str, files: dict[str, bytes], chunk: int = 64 * 1024):
    def messages():
        yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name=name))
        for file, data in files.items():
            for i in range(0, max(len(data), 1), chunk):
                yield gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file=file, data=data[i : i + chunk]))

    return stack.api.UploadAdapter(messages(), timeout=60)


def _adapter_files(name: str) -> dict[str, bytes]:
    path = demo_adapters()[name]
    return {f: (path / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}


def test_uploaded_adapter_serves_at_once_and_a_bad_upload_hurts_nobody(stack):
    info = _upload(stack, "fresh-rot13", _adapter_files("rot13"))
    assert info.rank == 64 and info.version >= 1
    fresh = _stream(stack, adapter="fresh-rot13", text="the quiet king", max_new_tokens=NEW_TOKENS)
    original = _stream(stack, adapter="rot13", text="the quiet king", max_new_tokens=NEW_TOKENS)
    assert fresh[0] == original[0]

    background: dict = {}
    thread = threading.Thread(
        target=lambda: background.update(
            result=_stream(stack, adapter="title", text="the quiet king", max_new_tokens=40)
        )
    )
    thread.start()
    broken = _adapter_files("upper") | {"adapter_config.json": b"{not json"}
    with pytest.raises(grpc.RpcError) as info:
        _upload(stack, "broken", broken)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "JSON" in info.value.details()
    thread.join()
    assert background["result"][2].usage.completion_tokens > 0
    names = [a.name for a in stack.api.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters]
    assert "fresh-rot13" in names and "broken" not in names


def test_one_trace_per_request_spans_all_four_roles(stack, collector):
    _upload(stack, "traced", _adapter_files("novowel"))  # a cold adapter: the worker fetches it from the store
    _, _, summary = _stream(stack, adapter="traced", text="the quiet king", max_new_tokens=8)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        traces = [
            spans
            for spans in collector.traces().values()
            if any(s["attributes"].get("loraserve.request_id") == summary.request_id for s in spans)
        ]
        services = {s["service"] for spans in traces for s in spans}
        if len(services) == 4:
            break
        time.sleep(0.3)
    assert len(traces) == 1, "all spans of a request share one trace id"
    names = {s["name"] for s in traces[0]}
    assert services == {"loraserve-gateway", "loraserve-scheduler", "loraserve-worker", "loraserve-adapter-store"}
    assert {"gateway.generate", "scheduler.queue", "worker.prefill", "worker.decode", "worker.adapter_fetch"} <= names
    fetch = next(s for s in traces[0] if s["name"] == "worker.adapter_fetch")
    # the gateway's hint starts the fetch before the ASSIGN: the request joins it (cold) or finds it loaded (hit)
    assert fetch["attributes"]["loraserve.adapter.source"] in ("cold", "hit")


def test_loraserve_up_shows_the_demo_and_stops_cleanly():
    base, bind = free_port_block(6), f"127.0.0.1:{free_port_block(1)}"
    command = [sys.executable, "-m", "loraserve.cli", "up", "--show-demo", "--base-port", str(base), "--bind", bind]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 240
        for line in process.stdout:
            lines.append(line)
            if "Ctrl-C stops every process" in line or time.monotonic() > deadline:
                break
        output = "".join(lines)
        assert "loraserve is up" in output and "concurrent streams through the gRPC API" in output, output[-3000:]
        for name in demo_adapters():
            assert name in output
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    time.sleep(0.5)
    pattern = f"--base-port {base}|127.0.0.1:{base + 2}|{bind}"
    leftovers = subprocess.run(["pgrep", "-f", pattern], check=False, capture_output=True)
    assert leftovers.stdout.strip() == b"", "no role may outlive `loraserve up`"
