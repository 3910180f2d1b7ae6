"""`loraserve bench --suite logprobs` at a tiny size: every variant measured, and the arithmetic."""

from __future__ import annotations

import json

import pytest

from loraserve.bench import cli
from loraserve.bench.suites.logprobs import suite as logprobs


def test_tiny_run_writes_every_variant(tmp_path, monkeypatch):
    monkeypatch.setattr(
        logprobs, "QUICK", logprobs.LogprobsPreset(batches=(1, 4), new_tokens=5, prompt_tokens=20, repeats=1)
    )
    monkeypatch.setattr(logprobs, "VOCABULARIES", (2048,))
    assert cli.run(["--suite", "logprobs", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["suite"] == "logprobs" and {"cpu", "cores", "torch"} <= set(results["machine"])
    for kind in ("records", "prefill"):  # decode, then prefill
        records = results[kind]
        assert {(r["batch"], r["variant"]) for r in records} == {(b, v) for b in (1, 4) for v in logprobs.VARIANTS}
        for r in records:
            assert r["step_ms"] > 0 and r["overhead"] == pytest.approx(r["step_ms"] / r["off_step_ms"] - 1)
    logits = results["logits"]
    assert {(r["vocab"], r["rows"], r["top"]) for r in logits} == {(2048, n, k) for n in (1, 4) for k in (0, 20)}
    assert all(r["ms"] > 0 and r["log_softmax_ms"] > 0 for r in logits)
