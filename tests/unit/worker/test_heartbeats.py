"""A worker's heartbeats come from its I/O thread on their own schedule, however long its step runs.

A real worker service (emulated engine, `inproc_worker.py`) whose one step takes 2 s (a 400-token
prefill at 5 ms a token): reports come only between steps, but the scheduler's side hears from the
worker every 0.25 s all along, and the heartbeats say how long the step under way has run.
"""

from __future__ import annotations

from itertools import pairwise

from emulated import fixed_profile
from inproc_worker import InprocWorker

from loraserve.params import SamplingParams

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
