"""`loraserve bench --suite engine-scaling` through its CLI, at a tiny size: results.json's records, ratios
and target."""

from __future__ import annotations

import json

import pytest

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.engine_scaling import suite as engine_scaling


def test_tiny_run_writes_results_json(tmp_path):
    argv = ["--suite", "engine-scaling", "--adapters", "1", "3", "--requests", "4", "--prompt-len", "4"]
    argv += ["--output-len", "2", "--max-batch-size", "4", "--ranks", "8", "--out", str(tmp_path / "out")]
    assert bench_main.run(argv) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["suite"] == "engine-scaling" and saved["machine"]["threads"] == 1 and "commit" in saved
    assert [r["n_adapters"] for r in saved["records"]] == [1, 3]
    first, last = saved["records"]
    assert all(r["tokens_per_s"] > 0 and r["steps"] > 0 for r in saved["records"])
    assert saved["ratio"] == pytest.approx(last["tokens_per_s"] / first["tokens_per_s"], abs=1e-3)
    (target,) = saved["targets"]
    assert target == {
        "name": "throughput(n=3) / throughput(n=1)",
        "goal": ">= 0.9",
        "value": saved["ratio"],
        "met": saved["ratio"] >= 0.9,
    }
    assert saved["settings"]["adapters"] == [1, 3] and saved["settings"]["requests"] == 4


def test_the_target_is_the_ratio_against_0_9():
    rows = [{"n_adapters": 1}, {"n_adapters": 1000}]
    assert engine_scaling.targets(rows, 0.52)[0]["met"] is False
    assert engine_scaling.targets(rows, 0.9)[0]["met"] is True
