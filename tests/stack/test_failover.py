"""Failover, drain and restarts on a real two-worker stack.

Each test first runs a batch of concurrent streams undisturbed (the reference), then the same
batch again while a role is killed, stopped, restarted or drained, and checks that every stream
completes with status OK and exactly the reference's tokens: greedy ones, and seeded sampled
ones (draws are keyed by (seed, position), so a continuation on another worker draws the same).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from helpers import mixed_requests
from stack import LocalStack

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow

ADAPTERS = ["upper", "title", "rot13", "reverse", ""]
NEW_TOKENS = 160


@pytest.fixture(scope="module")
def stack():
    stack = LocalStack(
        DEMO_MODEL_DIR, workers=2, max_batch_size=16, pool_pages=1024, worker_timeout=1.5, drain_timeout=20.0
    ).start()
    stack.wait_workers(2)
    yield stack
    stack.stop()


def _requests(count: int) -> list[gateway_pb2.GenerateRequest]:
    """Greedy and seeded-sampling requests over several adapters (and the base model)."""
    return mixed_requests(count, ADAPTERS, NEW_TOKENS, seed_base=1000)


@dataclass
class _Run:
    """Streams running in threads; `received[i]` counts the tokens stream i has got so far."""

    received: list[int]
    results: list = field(default_factory=list)  # (tokens, summary) or a grpc.RpcError, per stream


def _run(stack, requests, during: Callable[[_Run], None] | None = None, timeout_s: float = 120.0) -> _Run:
    run = _Run([0] * len(requests), [None] * len(requests))

    def one(i: int) -> None:
        tokens, summary = [], None
        try:
            for event in stack.api.GenerateStream(requests[i], timeout=timeout_s):
                if event.HasField("chunk"):
                    tokens += event.chunk.token_ids
                    run.received[i] = len(tokens)
                else:
                    summary = event.summary
            run.results[i] = (tokens, summary)
        except grpc.RpcError as e:
            run.results[i] = e

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(one, i) for i in range(len(requests))]
        if during is not None:
            during(run)
        for f in futures:
            f.result()
    return run


def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _mid_stream(run: _Run, count: int) -> None:
    """Until `count` streams have tokens, or the furthest is halfway through (a stream that starts late, its
    adapter cold on the worker it was placed on, must not let the others finish first); none has finished."""
    _until(
        lambda: sum(n > 0 for n in run.received) >= count or max(run.received) >= NEW_TOKENS // 2,
        60,
        f"{count} streams under way",
    )
    assert max(run.received) < NEW_TOKENS, "streams finished before the disruption: raise NEW_TOKENS"


def _tokens(run: _Run) -> list[list[int]]:
    errors = [r for r in run.results if isinstance(r, grpc.RpcError)]
    assert not errors, [(e.code(), e.details()) for e in errors]
    return [tokens for tokens, _ in run.results]


def _restore(stack, name: str) -> None:
    stack.stack.restart(name)
    stack.wait_workers(2)


def test_streams_on_a_killed_worker_continue_on_the_other_one(stack):
    requests = _requests(20)
    reference = _tokens(_run(stack, requests))
    assert all(len(t) == NEW_TOKENS for t in reference)

    def kill(run: _Run) -> None:
        _mid_stream(run, 20)
        stack.process("worker-0").send_signal(signal.SIGKILL)

    run = _run(stack, requests, kill)
    assert _tokens(run) == reference, "a stream that failed over differs from the undisturbed run"
    assert {summary.worker_id for _, summary in run.results} == {"worker-1"}
    assert sum(summary.failovers for _, summary in run.results) > 0, "some streams were on worker-0"
    assert all(s.finish_reason == common_pb2.FINISH_REASON_LENGTH for _, s in run.results)
    assert [w.worker_id for w in stack.cluster().workers] == ["worker-1"], "the dead worker was dropped"
    _restore(stack, "worker-0")


def test_streams_on_a_stopped_worker_fail_over_and_the_resumed_worker_rejoins_clean(stack):
    requests = _requests(12)
    reference = _tokens(_run(stack, requests))
    victim = stack.process("worker-0")

    def stop(run: _Run) -> None:
        _mid_stream(run, 12)
        victim.send_signal(signal.SIGSTOP)

    try:
        run = _run(stack, requests, stop)
        assert _tokens(run) == reference
        assert [w.worker_id for w in stack.cluster().workers] == ["worker-1"]
    finally:
        victim.send_signal(signal.SIGCONT)
    # Back from the dead: it is told to drop what it held (already failed over) and re-registers empty.
    _until(lambda: any(w.worker_id == "worker-0" and w.ready for w in stack.cluster().workers), 20, "re-registration")
    worker = next(w for w in stack.cluster().workers if w.worker_id == "worker-0")
    assert worker.running == 0 and worker.waiting == 0
    _until(lambda: all(w.kv_pages == 0 for w in stack.cluster().workers), 10, "the zombie's pages freed")
    assert _tokens(_run(stack, requests[:4])) == reference[:4]


def test_queued_and_running_requests_survive_a_scheduler_restart(stack):
    requests = _requests(40)  # 32 run (16 per worker), 8 wait in the scheduler's queue
    reference = _tokens(_run(stack, requests))

    def submitted() -> bool:
        state = stack.cluster()
        return state.queue_length + sum(w.running + w.waiting for w in state.workers) == len(requests)

    def restart(run: _Run) -> None:
        _mid_stream(run, 16)
        _until(submitted, 30, "every request to reach the scheduler")
        assert stack.cluster().queue_length > 0, "some requests should wait in the scheduler's queue"
        stack.process("scheduler").send_signal(signal.SIGKILL)
        stack.process("scheduler").wait()
        time.sleep(1.0)
        stack.stack.restart("scheduler")

    run = _run(stack, requests, restart)
    assert _tokens(run) == reference
    stack.wait_workers(2)


def test_a_draining_worker_finishes_its_streams_and_takes_no_new_ones(stack):
    requests = _requests(10)
    reference = _tokens(_run(stack, requests))
    drained: list[str] = []

    def drain(run: _Run) -> None:
        _mid_stream(run, 10)
        busiest = max(stack.cluster().workers, key=lambda w: w.running).worker_id  # placement consolidates
        drained.append(busiest)
        stack.process(busiest).send_signal(signal.SIGTERM)
        _until(lambda: any(w.draining for w in stack.cluster().workers), 5, "the draining report")
        summary = stack.api.Generate(gateway_pb2.GenerateRequest(text="the quiet king", max_new_tokens=4), timeout=30)
        assert summary.worker_id != busiest, "nothing new is placed on a draining worker"

    run = _run(stack, requests, drain)
    assert _tokens(run) == reference
    assert drained[0] in {summary.worker_id for _, summary in run.results}, "it finished its own streams"
    assert stack.process(drained[0]).wait(timeout=30) == 0
    _restore(stack, drained[0])


def test_a_draining_gateway_finishes_its_streams_and_refuses_new_ones(stack):
    requests = _requests(10)
    reference = _tokens(_run(stack, requests))
    refused: list[grpc.RpcError] = []

    def drain(run: _Run) -> None:
        _mid_stream(run, 10)
        stack.process("gateway").send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            stack.api.Generate(gateway_pb2.GenerateRequest(text="the quiet king", max_new_tokens=4), timeout=5)
        except grpc.RpcError as e:
            refused.append(e)

    run = _run(stack, requests, drain)
    assert _tokens(run) == reference
    assert refused and refused[0].code() == grpc.StatusCode.UNAVAILABLE, refused
    assert "shutting down" in refused[0].details()
    assert stack.process("gateway").wait(timeout=30) == 0
    stack.stack.restart("gateway")
    _until(lambda: _answers(stack), 60, "the restarted gateway")


def _answers(stack) -> bool:
    try:
        stack.api.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=2)
    except grpc.RpcError:
        return False
    return True


def test_after_a_long_scheduler_outage_the_stack_serves_again_within_seconds(stack):
    """gRPC's default reconnect backoff grows to minutes; ours is capped at 1 s."""
    stack.process("scheduler").send_signal(signal.SIGKILL)
    stack.process("scheduler").wait()
    time.sleep(30.0)  # long enough for an uncapped backoff (1 s, x1.6 per try) to pass 10 s
    stack.stack.restart("scheduler")
    restarted = time.monotonic()

    def serves() -> bool:
        try:
            stack.api.Generate(gateway_pb2.GenerateRequest(text="the quiet king", max_new_tokens=2), timeout=5)
        except grpc.RpcError:
            return False
        return True

    _until(serves, 30, "the stack to serve again")
    assert time.monotonic() - restarted < 6.0, "reconnecting took longer than the capped backoff allows"
    stack.wait_workers(2)


def test_without_a_store_or_a_scheduler_requests_fail_fast_with_unavailable(stack):
    request = gateway_pb2.GenerateRequest(adapter="upper", text="the quiet king", max_new_tokens=4)
    served = stack.api.Generate(request, timeout=20)  # a worker now holds "upper"
    stack.process("adapter-store").send_signal(signal.SIGKILL)
    stack.process("adapter-store").wait()
    time.sleep(0.5)  # the gateway notices its watch of the store broke
    again = stack.api.Generate(request, timeout=20)
    assert again.token_ids == served.token_ids, "a known adapter still serves from the gateway's and worker's caches"
    with pytest.raises(grpc.RpcError) as info:
        stack.api.Generate(gateway_pb2.GenerateRequest(adapter="never-registered", text="the quiet king"), timeout=20)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "adapter store" in info.value.details()
    stack.process("scheduler").send_signal(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stack.api.Generate(gateway_pb2.GenerateRequest(text="the quiet king"), timeout=20)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "scheduler" in info.value.details()
    assert time.monotonic() - started < 2, "no hang while no scheduler answers"
