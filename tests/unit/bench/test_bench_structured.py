"""`loraserve bench --suite structured` through its CLI, at a tiny size: the records and their arithmetic."""

from __future__ import annotations

import json

import pytest

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.structured import suite as structured
from loraserve.flags import EnvArgumentParser


def test_tiny_suite_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(structured, "QUICK", structured.StructuredPreset(batch=4, new_tokens=6, repeats=1))
    runs = []
    run = structured._run
    monkeypatch.setattr(structured, "_run", lambda *a: runs.append((a[2], out := run(*a))) or out)
    parser = EnvArgumentParser()
    bench_main.add_arguments(parser)
    args = parser.parse_args(["--suite", "structured", "--quick", "--out", str(tmp_path / "out")])
    assert bench_main.main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {"cpu", "cores", "torch"} <= set(results["machine"])
    records = results["records"]
    assert {(r["grammar"], r["constrained"]) for r in records} == {(k, n) for k in structured.GRAMMARS for n in (1, 4)}
    for r in records:
        assert (
            r["batch"] == 4 and r["full_batch_steps"] == 4
        )  # 6 tokens: a prefill, 4 decode steps, the last (ends all)
        assert r["overhead"] == pytest.approx(r["step_ms"] / r["free_step_ms"] - 1)
        assert r["mask_ms_per_request"] > 0 and r["mask_wait_ms_per_step"] >= 0
    assert all(out["mask_s_per_request"] == 0 for constrained, out in runs if constrained == 0)  # nothing to mask
