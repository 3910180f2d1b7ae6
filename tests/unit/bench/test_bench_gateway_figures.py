"""The gateway suite's figures: the gateway's CPU time read finer than a clock tick, a run it cannot
resolve left without a figure, and a baseline comparison that never divides by one."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from loraserve.bench.common.cpu_clock import process_cpu_seconds
from loraserve.bench.suites.gateway.suite import summarize, targets

# A child that waits for a line, spins for 3 ms of its own CPU time, then waits for another line.
SPIN = """
import sys, time
sys.stdin.readline()
start = time.thread_time()
while time.thread_time() - start < 0.003:
    pass
print("spun", flush=True)
sys.stdin.readline()
"""


def test_another_process_cpu_time_is_read_below_a_clock_tick():
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # the interpreter's start-up is behind it
        before = process_cpu_seconds(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "spun\n"
        spent = process_cpu_seconds(child.pid) - before
        # 3 ms is under Linux's 10 ms tick, in which psutil's reading moves: this one sees the spin itself.
        assert 0.003 <= spent < 0.003 + 0.05
        times = psutil.Process(child.pid).cpu_times()
        assert process_cpu_seconds(child.pid) == pytest.approx(times.user + times.system, abs=0.02)
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        process_cpu_seconds(child.pid)


def _record(api: str, us: float | None) -> dict:
    return {"api": api, "run": 0, "tokens": 48, "wall_s": 0.05, "gateway_cpu_s": 0.0, "us_per_token": us}


def test_the_summary_is_the_median_of_the_runs_that_have_a_figure():
    records = [_record("grpc", 10.0), _record("grpc", None), _record("grpc", 30.0), _record("http", None)]
    assert summarize(records) == {"grpc": 20.0, "http": None}


@pytest.mark.parametrize("now", [{"grpc": 0.0, "http": 50.0}, {"grpc": None, "http": 50.0}])
def test_a_run_without_a_figure_leaves_its_target_unjudged(tmp_path, now):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"commit": "abc1234", "summary": {"grpc": 120.0, "http": 100.0}}))
    grpc, http = targets(now, baseline)
    assert (grpc["value"], grpc["met"]) == (None, None)
    assert (http["value"], http["met"]) == (2.0, True) and "abc1234" in http["name"]


def test_a_baseline_without_a_figure_leaves_its_target_unjudged(tmp_path):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"commit": "abc1234", "summary": {"grpc": None, "http": 80.0}}))
    grpc, http = targets({"grpc": 40.0, "http": 50.0}, baseline)
    assert (grpc["value"], grpc["met"]) == (None, None)
    assert (http["value"], http["met"]) == (1.6, False)
