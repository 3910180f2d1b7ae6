"""`loraserve bench --suite choices` through its CLI, at a tiny size: the records and their arithmetic."""

from __future__ import annotations

import json

import pytest

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.choices import suite as choices
from loraserve.flags import EnvArgumentParser


def test_tiny_suite_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(choices, "QUICK", choices.ChoicesPreset(("demo",), n=3, prompt_len=20, new_tokens=3, repeats=1))
    parser = EnvArgumentParser()
    bench_main.add_arguments(parser)
    args = parser.parse_args(["--suite", "choices", "--quick", "--out", str(tmp_path / "out")])
    assert bench_main.main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {"cpu", "cores", "torch"} <= set(results["machine"])
    (record,) = results["records"]
    assert (record["model"], record["n"], record["prompt_len"]) == ("demo", 3, 20)
    # the prompt once; then, in one step, each other choice's last prompt token and the first's next token
    assert record["prefill_tokens_shared"] == 20 + 2 + 1
    assert record["prefill_tokens_alone"] == 3 * 20
    assert record["ttft_speedup"] == pytest.approx(record["ttft_ms_alone"] / record["ttft_ms_shared"])
    assert record["total_speedup"] == pytest.approx(record["total_ms_alone"] / record["total_ms_shared"])
