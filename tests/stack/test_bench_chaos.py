"""The chaos benchmark (`loraserve bench --suite chaos`): its schedule, its requests and its figures
as pure functions, its flags, and one short real run on a three-worker stack with two kills."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.chaos import suite as chaos
from loraserve.bench.suites.chaos.plan import (
    SEED_BASE,
    SIGNALS,
    ChaosConfig,
    chaos_requests,
    choose_victim,
    disruption_schedule,
)
from loraserve.bench.suites.chaos.report import (
    OK,
    AppliedDisruption,
    StreamRecord,
    attribute,
    chaos_targets,
    max_gap,
    percentiles,
    summarize_chaos,
)
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.flags import EnvArgumentParser


# ---- the plan ------------------------------------------------------------------------------------
def test_schedule_is_seeded_inside_the_quiet_margins_with_the_mean_interval():
    config = ChaosConfig(duration_s=50_000.0, interval_s=10.0, quiet_s=5.0, seed=3)
    schedule = disruption_schedule(config)
    assert schedule == disruption_schedule(config)
    assert schedule != disruption_schedule(ChaosConfig(duration_s=50_000.0, interval_s=10.0, quiet_s=5.0, seed=4))
    times = np.array([d.at_s for d in schedule])
    assert times.min() >= 5.0 and times.max() < 50_000.0 - 5.0
    assert np.all(np.diff(times) >= 0)
    assert np.diff(times).mean() == pytest.approx(10.0, rel=0.05)  # ~5000 gaps: ~1.4 % std error
    kinds = [d.kind for d in schedule]
    for kind in SIGNALS:
        assert kinds.count(kind) / len(kinds) == pytest.approx(1 / 3, abs=0.03)
    assert all(0 <= d.pick < 1 for d in schedule)


def test_schedule_ignores_the_load_and_keeps_to_the_chosen_signals():
    base = ChaosConfig(duration_s=300.0, seed=1)
    assert disruption_schedule(base) == disruption_schedule(ChaosConfig(duration_s=300.0, seed=1, rate=20.0))
    only_kills = disruption_schedule(ChaosConfig(duration_s=300.0, seed=1, signals=("kill",)))
    assert only_kills and {d.kind for d in only_kills} == {"kill"}
    assert [d.at_s for d in only_kills] == [d.at_s for d in disruption_schedule(base)]


def test_victim_is_a_busy_open_worker_and_never_the_last_one_serving():
    workers = ["worker-2", "worker-0", "worker-1"]
    assert choose_victim(0.5, ["worker-1"], {"worker-1"}) is None
    assert choose_victim(0.5, [], set()) is None
    assert choose_victim(0.0, workers, set()) == "worker-0"
    assert choose_victim(0.999, workers, set()) == "worker-2"
    assert choose_victim(0.9, workers, {"worker-1"}) == "worker-1"  # the only one holding requests
    assert choose_victim(0.9, workers, {"worker-0", "worker-1"}) == "worker-1"
    assert choose_victim(0.1, ["worker-0", "worker-1"], {"worker-7"}) == "worker-0"  # busy but not open


def test_requests_mix_greedy_and_seeded_sampling_over_many_adapters():
    config = ChaosConfig(duration_s=200.0, rate=10.0, n_adapters=50, output_len=(16, 32), seed=2)
    adapters, requests = chaos_requests(config)
    assert len(adapters) == 50
    assert len(requests) / config.duration_s == pytest.approx(10.0, rel=0.1)
    assert len({r.request.adapter for r in requests}) > 25
    sampled = [r for r in requests if r.seed is not None]
    assert len(sampled) / len(requests) == pytest.approx(0.5, abs=0.05)
    assert len({r.seed for r in sampled}) == len(sampled) and min(r.seed for r in sampled) >= SEED_BASE
    assert all(16 <= r.request.max_new_tokens <= 32 for r in requests)
    assert chaos_requests(config) == (adapters, requests)
    _, greedy = chaos_requests(ChaosConfig(duration_s=20.0, sampled_fraction=0.0))
    assert all(r.seed is None for r in greedy)


@pytest.mark.parametrize(
    "bad",
    [
        {"workers": 1},
        {"signals": ()},
        {"signals": ("kill", "nuke")},
        {"rate": 0.0},
        {"sampled_fraction": 1.5},
        {"stop_s": 1.0, "worker_timeout_s": 1.5},
    ],
)
def test_config_is_validated(bad):
    with pytest.raises(ValueError):
        ChaosConfig(**bad)


# ---- the figures ---------------------------------------------------------------------------------
def test_max_gap_counts_the_wait_for_the_first_token_and_says_when_it_began():
    assert max_gap(0.0, []) is None
    assert max_gap(1.0, [1.25]) == pytest.approx((0.25, 1.0))
    assert max_gap(0.0, [0.05, 0.1, 1.6, 1.7]) == pytest.approx((1.5, 0.1))
    assert max_gap(0.0, [2.0, 2.1]) == pytest.approx((2.0, 0.0))  # lost before its first token


def test_percentiles():
    assert percentiles([], "x") == {"x_p50_s": None, "x_p99_s": None}
    out = percentiles(list(range(101)), "x")
    assert out == {"x_p50_s": 50.0, "x_p99_s": 99.0}


def _record(
    i: int, tokens: list[int], status: str = OK, failovers: int = 0, total: float = 1.0, gap: float = 0.1, at: float = 0
):
    return StreamRecord(
        f"req-{i}",
        "adapter-0000",
        bool(i % 2),
        len(tokens),
        0.0,
        status,
        "",
        list(tokens),
        failovers,
        "worker-0",
        ttft_s=0.05,
        total_s=total,
        max_gap_s=gap,
        max_gap_at_s=at,
    )


def test_a_failed_over_stream_is_attributed_to_the_one_disruption_in_its_longest_gap():
    kill = AppliedDisruption(5.0, "kill", "worker-0", signalled_s=5.02)
    stop = AppliedDisruption(9.0, "stop", "worker-1", signalled_s=9.0)
    skipped = AppliedDisruption(6.0, "term", None)
    assert attribute(_record(1, [1], gap=0.3, at=4.9), [kill, stop, skipped]) == "kill"
    assert attribute(_record(1, [1], gap=0.3, at=5.05), [kill, stop]) == "kill"  # a token sent before it, late
    assert attribute(_record(1, [1], gap=2.0, at=8.5), [kill, stop]) == "stop"
    assert attribute(_record(1, [1], gap=0.3, at=6.0), [kill, stop]) is None
    assert attribute(_record(1, [1], gap=5.0, at=4.5), [kill, stop]) is None  # both: ambiguous


def test_summary_counts_failures_failovers_mismatches_and_added_latency():
    reference = [_record(i, [i, i + 1], total=1.0, gap=0.1) for i in range(6)]
    chaos_run = [
        _record(0, [0, 1]),
        _record(1, [1, 2], failovers=1, total=3.0, gap=0.8, at=0.5),
        _record(2, [2, 99], failovers=2, total=2.0, gap=1.1, at=1.5),  # differs from the reference
        _record(3, [], status="UNAVAILABLE"),
        _record(4, [], status=""),  # never finished
        _record(5, [5, 6], total=1.5, gap=0.2),
    ]
    disruptions = [
        AppliedDisruption(1.0, "kill", "worker-0", signalled_s=1.0, recovery_s=8.0),
        AppliedDisruption(2.0, "stop", "worker-1", signalled_s=2.0, recovery_s=3.0),
        AppliedDisruption(3.0, "kill", None),
    ]
    s = summarize_chaos(reference, chaos_run, disruptions)
    assert s["requests"] == 6 and s["completed_ok"] == 4 and s["failed"] == 2
    assert s["failed_by_status"] == {"UNAVAILABLE": 1, "UNFINISHED": 1}
    assert s["failed_over_requests"] == 2 and s["failovers_total"] == 3
    assert s["compared"] == 4 and s["mismatches"] == 1 and s["mismatched_ids"] == ["req-2"]
    assert s["disruptions"] == {"kill": 1, "stop": 1} and s["disruptions_skipped"] == 1
    assert s["recovery"]["kill"]["recovery_p50_s"] == 8.0
    assert s["latency"]["chaos_failed_over"]["n"] == 2
    assert s["latency"]["chaos_not_failed_over"]["total_p50_s"] == pytest.approx(1.25)
    added = s["added_vs_reference"]
    assert added["failed_over"]["added_total_p50_s"] == pytest.approx(1.5)  # +2.0 and +1.0
    assert added["failed_over"]["added_max_gap_p50_s"] == pytest.approx(0.85)  # +0.7 and +1.0
    assert added["not_failed_over"]["added_total_p50_s"] == pytest.approx(0.25)
    assert added["failed_over_by_kill"]["added_total_p50_s"] == pytest.approx(2.0)  # req-1's gap holds the kill
    assert added["failed_over_by_stop"]["added_total_p50_s"] == pytest.approx(1.0)
    assert s["failed_over_unattributed"] == 0
    assert s["ratios"]["failed_over / not failed over, total p50"] == pytest.approx(2.0)
    targets = chaos_targets(s)
    assert [(t["value"], t["met"]) for t in targets] == [(2, False), ("1 of 4", False), (2, True)]
    assert all(set(t) == {"name", "goal", "value", "met"} for t in targets)


# ---- the command ---------------------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = EnvArgumentParser()
    bench_main.add_arguments(parser)
    return parser.parse_args(argv)


def test_suite_flags_and_their_environment_twins(monkeypatch):
    assert _parse([]).suite == "serving"  # the serving benchmark stays the default
    quick = chaos.config_from_args(_parse(["--suite", "chaos", "--quick", "--n-adapters", "64", "--seed", "5"]))
    assert quick.duration_s == chaos.QUICK.duration_s and quick.n_adapters == 64 and quick.seed == 5
    full = chaos.config_from_args(_parse(["--suite", "chaos"]))
    assert full.duration_s == chaos.FULL.duration_s and full.workers == 3 and full.signals == SIGNALS
    monkeypatch.setenv("LORASERVE_CHAOS_SIGNALS", "kill,stop")
    monkeypatch.setenv("LORASERVE_CHAOS_DURATION", "25")
    config = chaos.config_from_args(_parse(["--suite", "chaos", "--chaos-workers", "2", "--output-len", "8", "8"]))
    assert config.signals == ("kill", "stop") and config.duration_s == 25.0
    assert config.workers == 2 and config.output_len == (8, 8)
    with pytest.raises(SystemExit):
        chaos.config_from_args(_parse(["--suite", "chaos", "--chaos-signals", "kill", "nuke"]))


# ---- a real run ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_short_chaos_run_loses_no_stream_and_changes_no_token():
    """Three workers, 10 s of load, kills due at 3.2 s and 5.9 s (seed 5), each of a worker holding
    streams. Every stream completes, equal to its undisturbed reference."""
    config = ChaosConfig(
        duration_s=10.0,
        workers=3,
        rate=4.0,
        interval_s=3.0,
        signals=("kill",),
        n_adapters=8,
        output_len=(96, 160),
        max_batch_size=2,
        quiet_s=2.0,
        seed=5,
    )
    result = chaos.run_chaos(config, DEMO_MODEL_DIR)
    s = result["summary"]
    assert s["failed"] == 0, s["failed_by_status"]
    assert s["reference_failed"] == 0
    assert s["mismatches"] == 0, s["mismatched_ids"]
    assert s["compared"] == s["requests"] > 20
    assert s["disruptions"].get("kill", 0) >= 1
    assert s["failed_over_requests"] >= 1 and s["failovers_total"] >= s["failed_over_requests"]
    assert s["sampled_requests"] > 0
    assert all(d["recovery_s"] is not None for d in result["disruptions"] if d["worker"] is not None)
