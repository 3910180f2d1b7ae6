"""`loraserve bench --suite prefix` through its CLI, at a tiny size: the records and their arithmetic."""

from __future__ import annotations

import json

import pytest

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.prefix import suite as prefix
from loraserve.flags import EnvArgumentParser

TINY = prefix.PrefixPreset(
    adapters=2,
    tenants=2,
    conversations=1,
    turns=3,
    system_tokens=40,
    user_tokens=8,
    answer_tokens=4,
    concurrency=2,
    model="demo",
)


def _expected_hit_rate(p: prefix.PrefixPreset, per_page: int = 16) -> float:
    """Each turn finds the full pages of what the conversation's last turn computed: its prompt and
    its answer but the answer's last token (never fed back). Nothing is shared across tenants or
    adapters, and each (adapter, tenant) pair holds one conversation, so first turns find nothing."""
    prompt_tokens = cached = 0
    for turn in range(p.turns):
        prompt = p.system_tokens + (turn + 1) * p.user_tokens + turn * p.answer_tokens
        prompt_tokens += prompt
        if turn:
            computed_before = prompt - p.user_tokens - 1
            cached += min(computed_before // per_page, (prompt - 1) // per_page) * per_page
    return cached / prompt_tokens


def test_tiny_suite_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(prefix, "QUICK", TINY)
    parser = EnvArgumentParser()
    bench_main.add_arguments(parser)
    args = parser.parse_args(["--suite", "prefix", "--quick", "--out", str(tmp_path / "out")])
    assert bench_main.main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {"cpu", "cores", "torch"} <= set(results["machine"]) and results["model"] == "demo"
    assert results["suite"] == "prefix" and results["commit"]  # this checkout's
    by = {(r["workload"], r["cache"]): r for r in results["records"]}
    assert set(by) == {(w, c) for w in ("multi-turn", "unique") for c in ("on", "off")}
    requests = TINY.adapters * TINY.tenants * TINY.conversations * TINY.turns
    assert all(r["requests"] == requests for r in by.values())
    assert by["multi-turn", "on"]["hit_rate"] == pytest.approx(_expected_hit_rate(TINY))
    assert by["multi-turn", "off"]["hit_rate"] == by["unique", "on"]["hit_rate"] == by["unique", "off"]["hit_rate"] == 0
    for workload in ("multi-turn", "unique"):
        on, off = by[workload, "on"], by[workload, "off"]
        assert results["ratios"][f"{workload}_ttft_p50_speedup"] == pytest.approx(off["ttft_p50_s"] / on["ttft_p50_s"])
        assert results["ratios"][f"{workload}_throughput_ratio"] == pytest.approx(
            on["tokens_per_s"] / off["tokens_per_s"]
        )
        assert results["ratios"][f"{workload}_ttft_p99_ratio"] == pytest.approx(on["ttft_p99_s"] / off["ttft_p99_s"])
    for r in by.values():  # the timeline's figures: the two requests sent at the start, and the tail behind p99
        assert r["start_requests"] == TINY.concurrency
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["latency_p99_s"] <= r["seconds"]
        assert r["tail"] and r["tail"][0]["ttft_s"] == max(t["ttft_s"] for t in r["tail"]) >= r["ttft_p99_s"]
        assert r["prefill_steps"] <= r["steps"] and r["mean_batch_size"] <= TINY.concurrency
    # the first turns find nothing cached: the work ahead of the tail is the same with the cache on and off
    assert by["unique", "on"]["tokens_ahead_p99"] == by["unique", "off"]["tokens_ahead_p99"]
    names = {t["name"]: t for t in results["targets"]}
    p99 = names["multi-turn TTFT p99, cache on / off"]
    assert p99["goal"] == "<= 1.0" and p99["value"] == round(results["ratios"]["multi-turn_ttft_p99_ratio"], 3)
    assert p99["met"] == (p99["value"] <= 1.0)


def _record(workload: str, cache: str, ttft_p50: float | None, ttft_p99: float | None, tokens_per_s: float) -> dict:
    return {
        "workload": workload,
        "cache": cache,
        "ttft_p50_s": ttft_p50,
        "ttft_p99_s": ttft_p99,
        "tokens_per_s": tokens_per_s,
        "latency_p50_s": 1.0,
        "latency_p99_s": 2.0,
        "tokens_ahead_p99": 100,
    }


def test_targets_from_fixed_records_and_a_side_that_completed_nothing():
    from loraserve.bench.suites.prefix.targets import ratios, targets

    records = [
        _record("multi-turn", "on", 0.5, 7.7, 1600.0),
        _record("multi-turn", "off", 2.0, 7.0, 800.0),
        _record("unique", "on", None, None, 0.0),  # a side with no completed request
        _record("unique", "off", 2.0, 11.0, 760.0),
    ]
    got = {t["name"]: (t["value"], t["met"]) for t in targets(ratios(records))}
    assert got == {
        "multi-turn TTFT p50, cache off / on": (4.0, True),
        "multi-turn throughput, cache on / off": (2.0, True),
        "multi-turn TTFT p99, cache on / off": (1.1, False),
        "unique throughput, cache on / off": (0.0, False),
        "unique TTFT p99, cache on / off": (None, False),
    }
