"""A stack of emulated workers (`loraserve up --runner emulated`): the real gateway, scheduler, adapter
store and worker processes, with only the model's forward pass replaced. Generations through the gRPC
API give the offline emulated engine's tokens, and a worker killed mid-stream fails over without
changing any stream's tokens (they are a function of the sequence, as a greedy or seeded model's)."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from emulated import emulated_engine, fixed_profile
from helpers import mixed_requests
from stack import LocalStack

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.v1 import common_pb2, gateway_pb2
from loraserve.worker.engine import GenerateRequest
from loraserve.worker.sampling import SamplingParams

pytestmark = pytest.mark.slow

ADAPTERS = ["upper", "", "rot13", "title"]
NEW_TOKENS = 120
STEP_S = 0.008  # each emulated step: a stream of NEW_TOKENS lasts about a second


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return fixed_profile(tmp_path_factory.mktemp("emulated-stack") / "runner_profile.json", step_s=STEP_S)


@pytest.fixture(scope="module")
def stack(profile):
    stack = LocalStack(
        DEMO_MODEL_DIR,
        workers=2,
        runner="emulated",
        runner_profile=profile,
        max_batch_size=16,
        pool_pages=1024,
        worker_timeout=1.5,
    ).start()
    stack.wait_workers(2)
    yield stack
    stack.stop()


def _requests(count: int) -> list[gateway_pb2.GenerateRequest]:
    """Greedy and seeded-sampling requests over adapters and the base model."""
    return mixed_requests(count, ADAPTERS, NEW_TOKENS, seed_base=500)


def _stream_all(stack, requests, received: list[int]) -> list[tuple[list[int], gateway_pb2.GenerateResponse]]:
    """Every request as a stream, at once: each one's tokens and summary (`received[i]`: its count so far)."""

    def one(i: int) -> tuple[list[int], gateway_pb2.GenerateResponse]:
        tokens, summary = [], None
        for event in stack.api.GenerateStream(requests[i], timeout=120):
            if event.HasField("chunk"):
                tokens += event.chunk.token_ids
                received[i] = len(tokens)
            else:
                summary = event.summary
        assert summary is not None and summary.finish_reason == common_pb2.FINISH_REASON_LENGTH
        return tokens, summary

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, range(len(requests))))


def test_the_stack_gives_the_offline_emulated_engines_tokens(stack, profile):
    requests = [r for r in _requests(8) if not r.sampling.temperature]
    for r in requests:
        r.max_new_tokens = 40
    with ThreadPoolExecutor(len(requests)) as pool:
        replies = list(pool.map(lambda r: stack.api.Generate(r, timeout=60), requests))
    engine = emulated_engine(profile)
    try:
        offline = engine.generate(
            [
                GenerateRequest(prompt=r.text, adapter=r.adapter or None, sampling=SamplingParams(max_new_tokens=40))
                for r in requests
            ]
        )
    finally:
        engine.close()
    for reply, expected in zip(replies, offline, strict=True):
        assert list(reply.token_ids) == expected.token_ids
    assert {reply.worker_id for reply in replies} <= {"worker-0", "worker-1"}


def test_a_worker_killed_mid_stream_changes_no_stream(stack):
    requests = _requests(20)  # more than one worker's batch: both have streams
    reference = [tokens for tokens, _ in _stream_all(stack, requests, [0] * len(requests))]
    assert all(len(t) == NEW_TOKENS for t in reference)

    received = [0] * len(requests)
    killed = threading.Event()

    def kill() -> None:
        deadline = time.monotonic() + 60
        while sum(n > 0 for n in received) < len(requests):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.01)
        assert max(received) < NEW_TOKENS, "streams finished before the kill: raise NEW_TOKENS"
        stack.process("worker-0").send_signal(signal.SIGKILL)
        killed.set()

    with ThreadPoolExecutor(1) as pool:
        killer = pool.submit(kill)
        try:
            disturbed = _stream_all(stack, requests, received)
        except grpc.RpcError as e:
            pytest.fail(f"a stream failed: {e.code()}: {e.details()}")
        killer.result()
    assert killed.is_set()
    assert [tokens for tokens, _ in disturbed] == reference, "a failed-over stream differs from the undisturbed run"
    assert sum(summary.failovers for _, summary in disturbed) > 0, "some streams were on the killed worker"
    assert [w.worker_id for w in stack.cluster().workers] == ["worker-1"], "the dead worker was dropped"
