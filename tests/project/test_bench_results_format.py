"""Every benchmark suite writes its results in the one format (`bench/common/results.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.bench.cli import SUITES

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("name", sorted(SUITES))
def test_the_suite_writes_results_json_through_the_shared_writer(name):
    folder = BENCH / Path(*SUITES[name][0].split(".")[:-1])
    source = "\n".join(p.read_text() for p in sorted(folder.glob("*.py")))
    shared = ("write_results(", "publish(")
    assert any(w in source for w in shared), f"{folder}: the suite must write --out/results.json with write_results"
