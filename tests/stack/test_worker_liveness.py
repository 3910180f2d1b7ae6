"""A worker is never wedged or declared dead by one request, or by steps that run long.

Two real stacks. In the first, requests whose grammar is costly (nested counted repetition: most of a
second for its first mask, then over llguidance's limits) are sent straight to the scheduler, past the
gateway's checks, while another tenant's streams run through the gateway on the same worker: every
stream completes without a failover, the worker stays in the cluster all along, and each costly request
ends alone with INVALID_ARGUMENT naming structured output. In the second, an emulated worker's steps take
3 s each, longer than the scheduler's worker timeout (2 s): its heartbeats keep it, and its streams
complete where they started. In the third, the scheduler process is stopped for longer than the worker
timeout while a stream runs: on resuming it does not take its live worker for dead, and the stream ends
where it started. In the fourth, a worker started with `--cpu-cores` runs its step loop on that core while
it steps and anywhere while it waits for work (`worker/cpu_cores.py`: pinned and idle on a core a busy
process computes on, the loop waited seconds to run, and the heartbeats with it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq
from emulated import fixed_profile
from llguidance import LLMatcher
from stack import LocalStack

from loraserve import internal_auth
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.demo.corpus import HELD_OUT_PROMPTS
from loraserve.params import SamplingParams, encode_sampling
from loraserve.sockets import make_socket
from loraserve.v1 import common_pb2, gateway_pb2, scheduler_pb2
from loraserve.wire import Tokens, decode

pytestmark = pytest.mark.slow

POISON = LLMatcher.grammar_from_regex("(x{1000}){1000}")
WORKER_TIMEOUT_S = 2.0


class ClusterWatch:
    """Samples the scheduler's worker list every 0.1 s on a thread, to tell whether a worker ever left it."""

    def __init__(self, stack: LocalStack):
        self.stack, self.samples = stack, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(sorted(w.worker_id for w in self.stack.cluster().workers))

    def stop(self) -> list[list[str]]:
        self._stop.set()
        self._thread.join(10)
        return self.samples


def _stream(stack: LocalStack, request: gateway_pb2.GenerateRequest) -> tuple[list[int], gateway_pb2.GenerateResponse]:
    tokens, summary = [], None
    for event in stack.api.GenerateStream(request, timeout=120):
        if event.HasField("chunk"):
            tokens += event.chunk.token_ids
        else:
            summary = event.summary
    return tokens, summary


def _requests(count: int, new_tokens: int) -> list[gateway_pb2.GenerateRequest]:
    sampling = common_pb2.SamplingParameters(ignore_eos=True)
    return [
        gateway_pb2.GenerateRequest(
            text=HELD_OUT_PROMPTS[i % len(HELD_OUT_PROMPTS)], max_new_tokens=new_tokens, sampling=sampling
        )
        for i in range(count)
    ]


def test_costly_constraints_sent_past_the_gateway_end_alone_and_the_worker_serves_on():
    stack = LocalStack(DEMO_MODEL_DIR, 1, max_batch_size=16, worker_timeout=WORKER_TIMEOUT_S).start()
    ctx = zmq.Context()
    gateway_keys = internal_auth.load(stack.internal_keys, "gateway")
    auth = gateway_keys.authenticator(ctx)  # the sink admits the worker's key, as a gateway's does
    sink = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*", curve=gateway_keys.server())
    try:
        stack.wait_workers(1)
        watch = ClusterWatch(stack)
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(_stream, stack, r) for r in _requests(8, 48)]
            time.sleep(0.5)  # the other tenant's streams are running
            poison = [f"poison-{i}" for i in range(4)]
            for request_id in poison:
                submit = scheduler_pb2.SubmitRequest(
                    request_id=request_id,
                    prompt_ids=[1, 40, 41, 42],
                    max_new_tokens=16,
                    reply_to=sink.getsockopt_string(zmq.LAST_ENDPOINT),
                    sampling_params=encode_sampling(SamplingParams(max_new_tokens=16, grammar=POISON)),
                    tenant="attacker",
                    arrival_unix=time.time(),
                )
                stack.scheduler.Submit(submit, timeout=10, metadata=stack.internal_metadata)
            ends: dict[str, Tokens] = {}
            deadline = time.monotonic() + 60
            while len(ends) < len(poison):
                assert time.monotonic() < deadline, f"the costly requests never ended: {sorted(ends)}"
                if sink.poll(100):
                    message = decode(sink.recv_multipart())
                    if isinstance(message, Tokens) and message.finished:
                        ends[message.request_id] = message
            results = [s.result(timeout=120) for s in streams]
        samples = watch.stop()
    finally:
        sink.close(linger=0)
        auth.stop()
        ctx.term()
        stack.stop()

    for request_id, end in ends.items():
        assert end.error_status == "INVALID_ARGUMENT" and not end.retry, (request_id, end)
        assert end.error.startswith("structured_output:"), end.error
    for tokens, summary in results:
        assert len(tokens) == 48 and summary.failovers == 0, summary
    assert samples and all(s == ["worker-0"] for s in samples), f"the worker left the cluster: {samples}"


def test_a_worker_whose_steps_outlast_the_worker_timeout_is_kept(tmp_path):
    profile = fixed_profile(tmp_path / "runner_profile.json", step_s=1.5 * WORKER_TIMEOUT_S)
    stack = LocalStack(
        DEMO_MODEL_DIR, 1, runner="emulated", runner_profile=profile, worker_timeout=WORKER_TIMEOUT_S
    ).start()
    try:
        stack.wait_workers(1, timeout_s=120)  # its warm-up is two such steps
        watch = ClusterWatch(stack)
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda r: _stream(stack, r), _requests(2, 3)))
        samples = watch.stop()
    finally:
        stack.stop()
    for tokens, summary in results:
        assert len(tokens) == 3 and summary.failovers == 0, summary
    assert samples and all(s == ["worker-0"] for s in samples), f"the worker left the cluster: {samples}"


def test_a_scheduler_paused_past_the_worker_timeout_keeps_its_live_workers(tmp_path):
    profile = fixed_profile(tmp_path / "runner_profile.json", step_s=0.1)
    stack = LocalStack(
        DEMO_MODEL_DIR, 1, runner="emulated", runner_profile=profile, worker_timeout=WORKER_TIMEOUT_S
    ).start()
    try:
        stack.wait_workers(1, timeout_s=120)
        scheduler = stack.process("scheduler").pid
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream, stack, _requests(1, 50)[0])  # 5 s of steps
            time.sleep(1.0)
            os.kill(scheduler, signal.SIGSTOP)  # what a starved, paused or suspended process looks like
            time.sleep(1.5 * WORKER_TIMEOUT_S)
            os.kill(scheduler, signal.SIGCONT)
            tokens, summary = stream.result(timeout=120)
        watch = ClusterWatch(stack)
        time.sleep(1.0)
        samples = watch.stop()
    finally:
        stack.stop()
    assert len(tokens) == 50 and summary.failovers == 0, summary
    assert samples and all(s == ["worker-0"] for s in samples), f"the worker left the cluster: {samples}"


def _cores(pid: int) -> str:
    """The cores a process's main thread (the worker's step loop) may run on, as Linux lists them."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(line for line in status if line.startswith("Cpus_allowed_list")).split(":")[1].strip()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_a_pinned_worker_steps_on_its_cores_and_waits_anywhere(tmp_path):
    core, everywhere = str(max(os.sched_getaffinity(0))), _cores(os.getpid())
    profile = fixed_profile(tmp_path / "runner_profile.json", step_s=0.2)
    stack = LocalStack(DEMO_MODEL_DIR, 1, runner="emulated", runner_profile=profile, cpu_cores=core).start()
    try:
        stack.wait_workers(1, timeout_s=120)
        step_loop = stack.process("worker-0").pid
        waiting = [_cores(step_loop)]
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream, stack, _requests(1, 20)[0])  # 4 s of steps
            stepping = []
            while not stream.done():
                stepping.append(_cores(step_loop))
                time.sleep(0.1)
            tokens, _ = stream.result(timeout=60)
        time.sleep(0.5)
        waiting.append(_cores(step_loop))
    finally:
        stack.stop()
    assert len(tokens) == 20
    assert waiting == [everywhere, everywhere]
    assert stepping and stepping.count(core) >= len(stepping) // 2, stepping  # it may wait before its first step
