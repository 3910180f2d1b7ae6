"""The gateway's early adapter hints in the scheduler (`scheduler/hints.py`), on the pure policy.

A hint names the worker placement would choose and asks it to fetch the adapter (a PREFETCH scored 1.0),
at most once per (worker, adapter) within `repeat_after_s`; nothing when a worker holds the adapter (or,
adaptive, is loading it there). Adaptive placement of the request that follows goes where the hint went.
"""

from __future__ import annotations

import pytest
from test_scheduler_policy import assigned, report, request

from loraserve.scheduler.hints import AdapterHints
from loraserve.scheduler.policy import PolicyConfig, PrefetchOn, SchedulerPolicy

A = ("style", 3)


@pytest.fixture(params=["fcfs", "adaptive"])
def kind(request):
    return request.param


def test_a_hint_asks_the_chosen_worker_to_fetch_once(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("w1"), 0.0)
    hints = AdapterHints(repeat_after_s=1.0)
    first = hints.hint(policy, A, 16, "t", 0.0)
    assert first == PrefetchOn("w1", (A,), (1.0,))
    assert hints.hint(policy, A, 16, "t", 0.5) is None  # a burst for one cold adapter: one fetch
    policy.on_report(report("w1"), 1.4)  # still without the adapter
    if kind == "fcfs":  # adaptive counts it as being loaded on w1 for a while: no hint either way
        assert hints.hint(policy, A, 16, "t", 1.5) == first


def test_no_hint_where_the_adapter_is_resident(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("w1", resident=[A]), 0.0)
    assert AdapterHints().hint(policy, A, 16, "t", 0.0) is None
    assert AdapterHints().hint(SchedulerPolicy(PolicyConfig.of(kind)), A, 16, "t", 0.0) is None  # no worker


def test_the_request_after_a_hint_goes_where_the_hint_went():
    policy = SchedulerPolicy(PolicyConfig(policy="adaptive"))
    for worker in ("w1", "w2"):
        policy.on_report(report(worker), 0.0)
    hint = AdapterHints().hint(policy, A, 16, "t", 0.0)
    assert hint is not None
    policy.add(request("r", adapter=A), 0.01)
    assert assigned(policy.schedule(0.01)) == [(hint.worker_id, "r")]
    assert AdapterHints().hint(policy, A, 16, "t", 0.02) is None  # being loaded there now
