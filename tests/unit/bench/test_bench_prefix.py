"""`loraserve bench --suite prefix` through its CLI, at a tiny size: the records and their arithmetic."""

from __future__ import annotations

import json

import pytest

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.prefix import suite as prefix
from loraserve.flags import EnvArgumentParser

TINY = prefix.Preset(
    adapters=2,
    tenants=2,
    conversations=1,
    turns=3,
    system_tokens=40,
    user_tokens=8,
    answer_tokens=4,
    concurrency=2,
    repeats=1,
    model="demo",
)


def _expected_hit_rate(p: prefix.Preset, per_page: int = 16) -> float:
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
