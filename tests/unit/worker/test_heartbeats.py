"""A worker's heartbeats come from its I/O thread on their own schedule, however long its step runs.

A real worker service (emulated engine, `inproc_worker.py`) whose one step takes 2 s (a 400-token
prefill at 5 ms a token): reports come only between steps, but the scheduler's side hears from the
worker every 0.25 s all along, and the heartbeats say how long the step under way has run. An I/O thread
that was held up anyway (here a send that blocks) logs how late its heartbeat went out.
"""

from __future__ import annotations

import logging
import time
from itertools import pairwise

import zmq
from emulated import fixed_profile
from inproc_worker import InprocWorker

from loraserve.params import SamplingParams
from loraserve.sockets import make_socket
from loraserve.worker.fetch_threads import Wakeup
from loraserve.worker.io_thread import LATE_S, WorkerIO

PROMPT = [1] + [40 + i % 200 for i in range(399)]  # 400 tokens: one prefill step of ~2 s
PER_TOKEN_S = 0.005


def test_heartbeats_go_on_while_a_step_holds_the_step_loop(tmp_path):
    worker = InprocWorker(fixed_profile(tmp_path / "profile.json", step_s=0.001, per_token_s=PER_TOKEN_S))
    try:
        worker.wait_ready()
        worker.pump(0.6)  # idle: heartbeats say no step is under way
        worker.assign("long", PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True))
        worker.wait_ended("long")
        worker.pump(0.3)
    finally:
        worker.close()

    heartbeats, reports = worker.heartbeats(), worker.reports()
    assert heartbeats, "the worker sent no heartbeat"
    assert {h.worker_id for _, h in heartbeats} == {"w0"}
    assert {h.instance for _, h in heartbeats} == {r.instance for _, r in reports}, "the process's own instance"
    report_gaps = [b - a for (a, _), (b, _) in pairwise(reports)]
    assert max(report_gaps) > 1.5, "the test needs a step long enough to silence the reports"
    times = [t for t, _ in worker.from_worker]
    gaps = [b - a for a, b in pairwise(times)]
    assert max(gaps) < 0.75, f"{max(gaps):.2f} s without a word from the worker: its liveness hung on its step"
    longest = max(h.step_s for _, h in heartbeats)
    assert 1.0 < longest < 10.0, f"the heartbeats said the step had run {longest:.2f} s at most"
    assert any(h.step_s == 0.0 for _, h in heartbeats), "between steps a heartbeat says no step is under way"


class HeldUpIO(WorkerIO):
    """The worker's I/O thread whose next turn blocks for `hold_s` (as a send to a stuck peer would)."""

    hold_s = 0.0

    def _send_queued(self) -> None:
        hold, self.hold_s = self.hold_s, 0.0
        time.sleep(hold)
        super()._send_queued()


def test_a_heartbeat_sent_late_is_logged_with_how_late_and_every_threads_stack_written(caplog, capfd):
    ctx = zmq.Context()
    scheduler = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    wakeup = Wakeup()
    io = HeldUpIO(ctx, scheduler.getsockopt_string(zmq.LAST_ENDPOINT), "w1", wakeup, stacks_after_s=LATE_S)
    try:
        with caplog.at_level(logging.WARNING, logger="loraserve.worker.io_thread"):
            time.sleep(1.0)
            assert not [r for r in caplog.records if "late" in r.getMessage()], "on time: nothing logged"
            io.hold_s = LATE_S + 0.5
            time.sleep(LATE_S + 1.5)
    finally:
        io.close(linger_ms=0)
        wakeup.close()
        scheduler.close(linger=0)
    stacks = capfd.readouterr().err  # faulthandler's watchdog, once the thread was held up past stacks_after_s
    assert "Timeout (" in stacks and "in _send_queued" in stacks and "in sleep" not in stacks, stacks
    late = [r.getMessage() for r in caplog.records if "late heartbeat" in r.getMessage()]
    assert len(late) == 1 and "held up" in late[0] and "no step under way" in late[0], late
    seconds = float(late[0].split("sent ")[1].split(" s late")[0])
    assert LATE_S <= seconds <= LATE_S + 1.5, late
