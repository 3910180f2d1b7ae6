"""`loraserve bench --suite gateway` on a small load: every token the streams asked for is counted, over
both APIs, and a baseline file turns the medians into targets."""

from __future__ import annotations

import json

from loraserve.bench import cli as bench_cli


def test_the_gateway_suite_counts_every_token_and_compares_with_a_baseline(tmp_path):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"commit": "abc1234", "summary": {"grpc": 1e9, "http": 1e-9}}))
    flags = ["--gateway-streams", "4", "--gateway-tokens", "12", "--gateway-runs", "1", "--gateway-baseline", baseline]
    assert bench_cli.run(["--suite", "gateway", "--out", str(tmp_path), *map(str, flags)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["api"], r["tokens"]) for r in results["records"]] == [("grpc", 48), ("http", 48)]
    assert all(r["us_per_token"] > 0 and r["gateway_cpu_s"] > 0 for r in results["records"])
    assert set(results["summary"]) == {"grpc", "http"}
    assert [(t["met"], "abc1234" in t["name"]) for t in results["targets"]] == [(True, True), (False, True)]
