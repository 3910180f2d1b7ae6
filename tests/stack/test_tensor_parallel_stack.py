"""Tensor-parallel workers on a real stack: two workers, each its model split over two processes (gloo).

- Generations through the gateway, adapters fetched from the store as packed rows (each rank's part, cut by
  the store; rank 0 hands each other rank its own), are token-exact with transformers + peft.
- A rank that dies takes its worker down as one, at once even while the worker is idle; its streams
  continue on the other worker with exactly the tokens an undisturbed run gives.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from helpers import hf_greedy
from stack import LocalStack

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
PROMPTS = [[1, 40, 41, 42, 43], [1, 300, 12, 99], [1, 7, 7, 7, 200, 15], [1, 55]]
ADAPTERS = ["upper", "title", "rot13", ""]


@pytest.fixture(scope="module")
def stack():
    stack = LocalStack(
        DEMO_MODEL_DIR, workers=2, tensor_parallel=2, max_batch_size=8, pool_pages=512, worker_timeout=1.5
    ).start()
    stack.wait_workers(2)
    yield stack
    stack.stop()


def _request(prompt: list[int], adapter: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        adapter=adapter,
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        max_new_tokens=NEW_TOKENS,
        sampling=common_pb2.SamplingParameters(ignore_eos=True),
    )


def _streams(stack, requests, during=None) -> list[list[int]]:
    received = [0] * len(requests)

    def one(i: int) -> list[int]:
        tokens = []
        for event in stack.api.GenerateStream(requests[i], timeout=120):
            if event.HasField("chunk"):
                tokens += event.chunk.token_ids
                received[i] = len(tokens)
        return tokens

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(one, i) for i in range(len(requests))]
        if during is not None:
            during(received)
        return [f.result() for f in futures]


def test_split_workers_are_token_exact_with_peft(stack):
    adapters = demo_adapters()
    requests = [_request(p, a) for p, a in zip(PROMPTS, ADAPTERS, strict=True)]
    for request, tokens in zip(requests, _streams(stack, requests), strict=True):
        path = adapters[request.adapter] if request.adapter else None
        assert tokens == hf_greedy(DEMO_MODEL_DIR, path, list(request.token_ids.ids), NEW_TOKENS), request.adapter


def _follower(stack, worker: str) -> psutil.Process:
    leader = psutil.Process(stack.process(worker).pid)
    (follower,) = [p for p in leader.children() if "tensor_parallel.follower" in " ".join(p.cmdline())]
    return follower


def _until_not_ready(stack, worker: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(w.worker_id == worker and w.ready for w in stack.cluster().workers):
        assert time.monotonic() < deadline, f"{worker}, with a dead rank, still reports ready after {timeout_s} s"
        time.sleep(0.1)


def test_a_rank_that_dies_while_its_worker_is_idle_takes_the_worker_out_at_once(stack):
    """Not at its next request: the worker checks its ranks while it waits for work."""
    _follower(stack, "worker-1").send_signal(signal.SIGKILL)
    _until_not_ready(stack, "worker-1", timeout_s=5)
    stack.stack.restart("worker-1")
    stack.wait_workers(2)


def test_a_dead_rank_fails_its_worker_over_as_one(stack):
    requests = [_request(p, a) for p in PROMPTS for a in ADAPTERS]
    reference = _streams(stack, requests)
    follower = _follower(stack, "worker-0")

    def kill(received: list[int]) -> None:
        deadline = time.monotonic() + 60
        while sum(n > 0 for n in received) < len(received):
            assert time.monotonic() < deadline, "streams never got under way"
            time.sleep(0.02)
        assert max(received) < NEW_TOKENS, "streams finished before the kill: raise NEW_TOKENS"
        follower.send_signal(signal.SIGKILL)

    try:
        assert _streams(stack, requests, kill) == reference
    except grpc.RpcError as e:  # pragma: no cover - the message is the point
        pytest.fail(f"a stream failed instead of failing over: {e.code()} {e.details()}")
    _until_not_ready(stack, "worker-0", timeout_s=20)
