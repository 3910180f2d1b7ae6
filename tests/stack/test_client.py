"""loraserve.client: the retry policy on its own, then against a fake server, then against a real stack."""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import threading
import time
from collections import Counter
from concurrent import futures

import grpc
import pytest
from readme import README_API_ADDRESS, python_example
from stack import LocalStack

from loraserve.client import ApiError, AsyncClient, Chunk, Client, Generation, RetryPolicy
from loraserve.client.retry import NO_RETRY, Attempts
from loraserve.demo.assets import DEMO_ADAPTERS_DIR, DEMO_MODEL_DIR
from loraserve.demo.styles import shows_style
from loraserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPT = "the quiet king"
FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.1, max_backoff_s=0.3, multiplier=2.0, jitter=0.5)


# --- the policy, with a fake clock -------------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"fake {self._code.name}"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


UNAVAILABLE = FakeRpcError(grpc.StatusCode.UNAVAILABLE)


def test_backoff_grows_exponentially_up_to_its_cap_less_at_most_the_jitter():
    policy = RetryPolicy(max_attempts=10, initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.5)
    for retry in range(1, 10):
        ceiling = min(1.0, 0.1 * 2 ** (retry - 1))
        assert policy.backoff_s(retry, 0.0) == pytest.approx(ceiling)
        assert ceiling * 0.5 <= policy.backoff_s(retry, 0.999) <= ceiling
    assert policy.backoff_s(9, 0.0) == 1.0, "capped"


def test_unavailable_is_retried_max_attempts_minus_one_times_then_raised():
    clock = FakeClock()
    attempts = Attempts(FAST, timeout_s=60.0, clock=clock, rand=lambda: 0.0)
    delays = [attempts.after(UNAVAILABLE) for _ in range(FAST.max_attempts - 1)]
    assert delays == pytest.approx([0.1, 0.2, 0.3])
    with pytest.raises(ApiError) as info:
        attempts.after(UNAVAILABLE)
    assert info.value.code == "UNAVAILABLE" and info.value.details == "fake UNAVAILABLE"
    assert isinstance(info.value.__cause__, grpc.RpcError)


@pytest.mark.parametrize(
    "code", ["NOT_FOUND", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL"]
)
def test_only_unavailable_is_retried(code):
    attempts = Attempts(FAST, timeout_s=60.0, clock=FakeClock())
    with pytest.raises(ApiError) as info:
        attempts.after(FakeRpcError(grpc.StatusCode[code]))
    assert info.value.code == code


def test_no_retry_once_the_call_returned_part_of_its_answer_or_without_a_retry_policy():
    with pytest.raises(ApiError):
        Attempts(FAST, timeout_s=60.0, clock=FakeClock()).after(UNAVAILABLE, started=True)
    with pytest.raises(ApiError):
        Attempts(NO_RETRY, timeout_s=60.0, clock=FakeClock()).after(UNAVAILABLE)


def test_tries_share_one_deadline_and_no_backoff_outlives_it():
    clock = FakeClock()
    attempts = Attempts(FAST, timeout_s=0.5, clock=clock, rand=lambda: 0.0)
    assert attempts.timeout_s() == 0.5
    clock.now += attempts.after(UNAVAILABLE)  # waits 0.1
    assert attempts.timeout_s() == pytest.approx(0.4)
    clock.now += 0.25  # the second try took 0.25 s: 0.15 s left, the next backoff is 0.2
    with pytest.raises(ApiError):
        attempts.after(UNAVAILABLE)
    clock.now += 1.0
    assert attempts.timeout_s() == 0.0


def test_policy_values_are_checked():
    for bad in ({"max_attempts": 0}, {"initial_backoff_s": 0}, {"initial_backoff_s": 2, "max_backoff_s": 1}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


# --- which calls are retried: a fake server that fails the first tries ----------------------------------


class Flaky(gateway_pb2_grpc.LoraServeServicer):
    """Fails the first `failures` tries of each RPC with UNAVAILABLE; a failing GenerateStream first sends
    `chunks_first` chunks."""

    def __init__(self, failures: int, chunks_first: int = 0):
        self.failures = failures
        self.chunks_first = chunks_first
        self.tries: Counter[str] = Counter()

    def _fails(self, name: str) -> bool:
        self.tries[name] += 1
        return self.tries[name] <= self.failures

    def _try(self, name: str, context) -> None:
        if self._fails(name):
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{name} down")

    def Generate(self, request, context):
        self._try("Generate", context)
        return gateway_pb2.GenerateResponse(text="A", token_ids=[7], finish_reason=common_pb2.FINISH_REASON_LENGTH)

    def GenerateStream(self, request, context):
        if self._fails("GenerateStream"):
            for _ in range(self.chunks_first):
                yield gateway_pb2.GenerateStreamResponse(chunk=gateway_pb2.TokenChunk(text="A", token_ids=[7]))
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
        yield gateway_pb2.GenerateStreamResponse(chunk=gateway_pb2.TokenChunk(text="A", token_ids=[7]))
        yield gateway_pb2.GenerateStreamResponse(summary=gateway_pb2.GenerateResponse(finish_reason=2))

    def Tokenize(self, request, context):
        self._try("Tokenize", context)
        return gateway_pb2.TokenizeResponse(ids=[1], tokens=["a"])

    def GetModelInfo(self, request, context):
        self._try("GetModelInfo", context)
        return gateway_pb2.ModelInfo(model_type="llama")

    def ListAdapters(self, request, context):
        self._try("ListAdapters", context)
        return gateway_pb2.ListAdaptersResponse()

    def DescribeAdapter(self, request, context):
        self._try("DescribeAdapter", context)
        return common_pb2.AdapterInfo(name=request.name)

    def UploadAdapter(self, request_iterator, context):
        assert next(request_iterator).header.name
        assert sum(1 for _ in request_iterator) >= 2, "both files were sent"
        self._try("UploadAdapter", context)
        return common_pb2.AdapterInfo(name="x")

    def DeleteAdapter(self, request, context):
        self._try("DeleteAdapter", context)
        return gateway_pb2.DeleteAdapterResponse(version=1)


@contextlib.contextmanager
def serving(servicer: Flaky):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    gateway_pb2_grpc.add_LoraServeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


SAFE_CALLS = {
    "Generate": lambda c: c.generate(PROMPT),
    "GenerateStream": lambda c: list(c.stream(PROMPT)),
    "Tokenize": lambda c: c.tokenize(PROMPT),
    "GetModelInfo": lambda c: c.model_info(),
    "ListAdapters": lambda c: c.list_adapters(),
    "DescribeAdapter": lambda c: c.describe_adapter("upper"),
}
UNSAFE_CALLS = {
    "UploadAdapter": lambda c: c.upload_adapter("copy", DEMO_ADAPTERS_DIR / "upper"),
    "DeleteAdapter": lambda c: c.delete_adapter("upper"),
}


def _check_backoffs(sleeps: list[float]) -> None:
    for retry, delay in enumerate(sleeps, 1):
        ceiling = min(FAST.max_backoff_s, FAST.initial_backoff_s * FAST.multiplier ** (retry - 1))
        assert ceiling * (1 - FAST.jitter) <= delay <= ceiling


@pytest.mark.parametrize("method", SAFE_CALLS)
def test_safe_calls_are_retried_on_unavailable_until_they_succeed(method):
    servicer, sleeps = Flaky(failures=FAST.max_attempts - 1), []
    with serving(servicer) as address, Client(address, retry=FAST, sleep=sleeps.append) as client:
        SAFE_CALLS[method](client)
    assert servicer.tries[method] == FAST.max_attempts and len(sleeps) == FAST.max_attempts - 1
    _check_backoffs(sleeps)


@pytest.mark.parametrize("method", SAFE_CALLS)
def test_safe_calls_give_up_after_max_attempts(method):
    servicer, sleeps = Flaky(failures=100), []
    with (
        serving(servicer) as address,
        Client(address, retry=FAST, sleep=sleeps.append) as client,
        pytest.raises(ApiError) as info,
    ):
        SAFE_CALLS[method](client)
    assert info.value.code == "UNAVAILABLE"
    assert servicer.tries[method] == FAST.max_attempts and len(sleeps) == FAST.max_attempts - 1


@pytest.mark.parametrize("method", UNSAFE_CALLS)
def test_uploads_and_deletes_are_never_retried(method):
    servicer, sleeps = Flaky(failures=1), []
    with (
        serving(servicer) as address,
        Client(address, retry=FAST, sleep=sleeps.append) as client,
        pytest.raises(ApiError) as info,
    ):
        UNSAFE_CALLS[method](client)
    assert info.value.code == "UNAVAILABLE" and servicer.tries[method] == 1 and sleeps == []


def test_a_stream_that_yielded_a_token_is_not_retried():
    servicer, sleeps = Flaky(failures=1, chunks_first=1), []
    with serving(servicer) as address, Client(address, retry=FAST, sleep=sleeps.append) as client:
        events = client.stream(PROMPT)
        assert next(events) == Chunk("A", (7,))
        with pytest.raises(ApiError) as info:
            next(events)
    assert info.value.code == "UNAVAILABLE" and servicer.tries["GenerateStream"] == 1 and sleeps == []


def test_the_async_client_retries_the_same_calls():
    async def main(address: str, sleeps: list[float]) -> None:
        async def sleep(delay: float) -> None:
            sleeps.append(delay)

        async with AsyncClient(address, retry=FAST, sleep=sleep) as client:
            assert (await client.generate(PROMPT)).token_ids == (7,)
            streamed = [e async for e in client.stream(PROMPT)]
            assert streamed[0] == Chunk("A", (7,)) and isinstance(streamed[1], Generation)
            assert (await client.tokenize(PROMPT)).ids == (1,)
            with pytest.raises(ApiError, match="UNAVAILABLE"):
                await client.delete_adapter("upper")
            with pytest.raises(ApiError, match="UNAVAILABLE"):  # not UNKNOWN: the server got both files
                await client.upload_adapter("copy", DEMO_ADAPTERS_DIR / "upper")

    servicer, sleeps = Flaky(failures=2), []
    with serving(servicer) as address:
        asyncio.run(main(address, sleeps))
    assert servicer.tries == {"Generate": 3, "GenerateStream": 3, "Tokenize": 3, "DeleteAdapter": 1, "UploadAdapter": 1}
    assert len(sleeps) == 6

    async def partial_stream(address: str) -> list[Chunk | Generation]:
        seen: list[Chunk | Generation] = []
        async with AsyncClient(address, retry=FAST, sleep=asyncio.sleep) as client:
            with pytest.raises(ApiError, match="UNAVAILABLE"):
                async for event in client.stream(PROMPT):
                    seen.append(event)
        return seen

    servicer = Flaky(failures=1, chunks_first=1)
    with serving(servicer) as address:
        assert asyncio.run(partial_stream(address)) == [Chunk("A", (7,))]
    assert servicer.tries["GenerateStream"] == 1


def test_api_key_goes_in_the_authorization_metadata():
    seen: list[tuple] = []

    class Echo(Flaky):
        def Tokenize(self, request, context):
            seen.extend(context.invocation_metadata())
            return gateway_pb2.TokenizeResponse()

    with serving(Echo(failures=0)) as address, Client(address, api_key="k-123") as client:
        client.tokenize(PROMPT)
    assert ("authorization", "Bearer k-123") in [(m.key, m.value) for m in seen]


# --- against a real stack --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack():
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, max_batch_size=4)
    stack.start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


def _raw_stream(stack, request: gateway_pb2.GenerateRequest) -> tuple[list[int], str]:
    tokens, text = [], ""
    for event in stack.api.GenerateStream(request, timeout=60):
        tokens += event.chunk.token_ids
        text += event.chunk.text
    return tokens, text


def test_sync_generate_and_stream_match_the_raw_stub(stack):
    request = gateway_pb2.GenerateRequest(adapter="upper", text=PROMPT, max_new_tokens=16)
    raw = stack.api.Generate(request, timeout=60)
    with Client(stack.address) as client:
        result = client.generate(PROMPT, adapter="upper", max_new_tokens=16)
        events = list(client.stream(PROMPT, adapter="upper", max_new_tokens=16))
    assert result.token_ids == tuple(raw.token_ids) and result.text == raw.text
    assert f"FINISH_REASON_{result.finish_reason.upper()}" == common_pb2.FinishReason.Name(raw.finish_reason)
    assert result.usage.completion_tokens == len(raw.token_ids) and result.adapter_version >= 1
    assert result.timings.total_s > 0 and shows_style("upper", result.text)
    *chunks, summary = events
    assert all(isinstance(c, Chunk) for c in chunks) and isinstance(summary, Generation)
    assert [t for c in chunks for t in c.token_ids] == list(raw.token_ids) == list(summary.token_ids)
    assert "".join(c.text for c in chunks) == summary.text == raw.text
    assert (list(summary.token_ids), summary.text) == _raw_stream(stack, request)


def test_async_generate_and_stream_match_the_raw_stub(stack):
    request = gateway_pb2.GenerateRequest(adapter="rot13", text=PROMPT, max_new_tokens=16)
    raw = stack.api.Generate(request, timeout=60)

    async def main() -> tuple[Generation, list[Chunk | Generation]]:
        async with AsyncClient(stack.address) as client:
            result = await client.generate(PROMPT, adapter="rot13", max_new_tokens=16)
            return result, [e async for e in client.stream(PROMPT, adapter="rot13", max_new_tokens=16)]

    result, (*chunks, summary) = asyncio.run(main())
    assert result.token_ids == tuple(raw.token_ids) == summary.token_ids
    assert [t for c in chunks for t in c.token_ids] == list(raw.token_ids)
    assert result.text == summary.text == raw.text


def test_reads_return_typed_results(stack):
    with Client(stack.address) as client:
        info = client.model_info()
        tokens = client.tokenize(PROMPT, add_special_tokens=True)
        adapters = client.list_adapters()
        upper = client.describe_adapter("upper")
        by_ids = client.generate(tokens.ids, max_new_tokens=4)
    assert info.model_type == "llama" and info.ready_workers == 1 and info.eos_token_ids
    assert len(tokens.ids) == len(tokens.tokens) > 1
    assert "upper" in [a.name for a in adapters] and upper.rank > 0 and upper.target_modules
    assert by_ids.usage.prompt_tokens == len(tokens.ids)


def test_upload_a_demo_adapter_directory_then_generate_with_it_and_delete_it(stack):
    with Client(stack.address) as client:
        info = client.upload_adapter("client-upper", DEMO_ADAPTERS_DIR / "upper")
        assert info.name == "client-upper" and info.source == "upload" and info.version >= 1
        assert info.sha256 == client.describe_adapter("upper").sha256
        copy = client.generate(PROMPT, adapter="client-upper", max_new_tokens=16)
        original = client.generate(PROMPT, adapter="upper", max_new_tokens=16)
        assert copy.token_ids == original.token_ids and copy.adapter_version == info.version
        assert client.delete_adapter("client-upper") == info.version
        with pytest.raises(ApiError) as gone:
            client.describe_adapter("client-upper")
    assert gone.value.code == "NOT_FOUND"


def test_failures_raise_api_error_with_the_status(stack):
    with Client(stack.address) as client:
        with pytest.raises(ApiError) as unknown:
            client.generate(PROMPT, adapter="no-such-adapter")
        with pytest.raises(ApiError) as bad:
            client.generate(PROMPT, temperature=1000.0)
        with pytest.raises(ApiError) as streamed:
            list(client.stream(PROMPT, adapter="no-such-adapter"))
        with pytest.raises(ApiError) as late:
            client.generate(PROMPT, max_new_tokens=64, ignore_eos=True, timeout=0.001)
    assert unknown.value.code == streamed.value.code == "NOT_FOUND" and "no-such-adapter" in unknown.value.details
    assert bad.value.code == "INVALID_ARGUMENT" and "temperature" in bad.value.details
    assert late.value.code == "DEADLINE_EXCEEDED"
    with pytest.raises(TypeError, match="temprature"):
        Client(stack.address).generate(PROMPT, temprature=1.0)  # type: ignore[call-arg]


def test_the_readme_asyncio_example_runs(stack):
    code = python_example("AsyncClient(").replace(README_API_ADDRESS, stack.address)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().strip(), "it prints a completion"


def test_a_generate_sent_while_the_scheduler_is_down_succeeds_once_it_is_back(stack):
    """Runs last: it restarts the scheduler."""
    stack.process("scheduler").send_signal(signal.SIGKILL)
    stack.process("scheduler").wait()
    sleeps: list[float] = []

    def sleep(delay: float) -> None:
        sleeps.append(delay)
        time.sleep(delay)

    back = threading.Timer(1.0, stack.stack.restart, args=("scheduler",))
    policy = RetryPolicy(max_attempts=40, initial_backoff_s=0.1, max_backoff_s=1.0)
    try:
        with Client(stack.address, retry=policy, sleep=sleep) as client:
            back.start()
            result = client.generate(PROMPT, adapter="upper", max_new_tokens=8, timeout=60)
    finally:
        back.join()
    assert sleeps, "the first tries failed with UNAVAILABLE and were retried"
    assert len(result.token_ids) == 8 and result.text.strip() and result.text == result.text.upper()
    stack.wait_workers(1)
