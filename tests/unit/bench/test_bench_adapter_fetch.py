"""`loraserve bench --suite adapter-fetch`'s results.json: a record per transport and phase, the target
per transport (the measurement itself, a real store process, is what the GPU suite's stack part runs)."""

from __future__ import annotations

import json

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.adapter_fetch import suite as adapter_fetch


def _results(median_ms: float) -> list[adapter_fetch.Result]:
    return [
        adapter_fetch.Result("transfer", 3, 33.59, median_ms, median_ms + 2, median_ms - 1, 33.59 / median_ms),
        adapter_fetch.Result("transfer+parse", 3, 33.59, median_ms + 80, median_ms + 90, median_ms + 70, 0.3),
    ]


def test_results_json_through_the_cli(tmp_path, monkeypatch):
    medians = {"tcp": 31.5, "ipc": 18.0}
    seen = []

    def fake(args, workdir):
        seen.append(args.transport)
        return _results(medians[args.transport]), 40.0

    monkeypatch.setattr(adapter_fetch, "run_benchmark", fake)
    argv = ["--suite", "adapter-fetch", "--iterations", "3", "--out", str(tmp_path / "out")]
    assert bench_main.run(argv) == 0
    assert seen == ["tcp", "ipc"]  # both transports by default, each its own store
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["suite"] == "adapter-fetch" and {"cpu", "cores"} <= set(saved["machine"]) and "commit" in saved
    assert [(r["transport"], r["phase"]) for r in saved["records"]] == [
        ("tcp", "transfer"),
        ("tcp", "transfer+parse"),
        ("ipc", "transfer"),
        ("ipc", "transfer+parse"),
    ]
    assert all(r["first_fetch_ms"] == 40.0 and r["megabytes"] == 33.59 for r in saved["records"])
    assert [(t["value"], t["goal"], t["met"]) for t in saved["targets"]] == [
        (31.5, "<= 20", False),
        (18.0, "<= 20", True),
    ]
    assert saved["settings"]["iterations"] == 3 and saved["settings"]["transport"] == ["tcp", "ipc"]
