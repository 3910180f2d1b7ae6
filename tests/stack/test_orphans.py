"""A generation whose gateway died stops on the worker instead of running on to max_new_tokens.

Real processes: a one-worker stack with metrics; a long generation starts, its gateway is killed
with SIGKILL mid-stream, and the worker's step count (`loraserve_worker_step_seconds_count`: one
step per token of a lone generation) shows that it stopped within a few steps of the kill.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from stack import LocalStack, free_port_block, scrape_metrics

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 480  # the demo model's context is 512


def _steps(port: int) -> float:
    samples = scrape_metrics(port)
    return sum(v for (name, _), v in samples.items() if name == "loraserve_worker_step_seconds_count")


def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_generation_whose_gateway_was_killed_stops_on_the_worker():
    metrics_port = free_port_block(4)
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, metrics_port=metrics_port, torch_threads=1).start()
    worker_metrics = metrics_port + 3  # gateway, scheduler, store, then worker-0
    try:
        stack.wait_workers(1)
        before = _steps(worker_metrics)
        request = gateway_pb2.GenerateRequest(
            text="the quiet king",
            max_new_tokens=MAX_NEW_TOKENS,
            sampling=common_pb2.SamplingParameters(ignore_eos=True),
        )
        first_chunk = threading.Event()

        def stream() -> None:
            try:
                for event in stack.api.GenerateStream(request, timeout=60):
                    if event.HasField("chunk") and event.chunk.token_ids:
                        first_chunk.set()
            except grpc.RpcError:
                pass  # its gateway is killed under it

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first_chunk.wait(30), "the generation never started"
        stack.process("gateway").send_signal(signal.SIGKILL)
        at_kill = _steps(worker_metrics) - before
        assert at_kill < MAX_NEW_TOKENS / 4, f"{at_kill} steps before the kill: the generation is too short"

        _until(lambda: all(w.running == 0 and w.waiting == 0 for w in stack.cluster().workers), 30, "an idle worker")
        steps = _steps(worker_metrics) - before
        assert steps < at_kill + 40, (
            f"the worker ran {steps} steps ({at_kill} before the gateway died): the orphaned generation "
            f"ran on towards its {MAX_NEW_TOKENS} tokens"
        )
        reader.join(10)
    finally:
        stack.stop()
