"""`loraserve bench --suite cold`, its load part at two iterations: a real store process, every transfer path,
the records' fields (the stack part is what tests/stack/test_cold_start.py checks, with assertions)."""

from __future__ import annotations

from loraserve.bench.suites.cold.load import PATHS, measure_load
from loraserve.bench.suites.cold.stack import _record
from loraserve.bench.suites.cold.targets import targets


def test_every_load_path_is_measured_against_memcpy():
    records = {r["path"]: r for r in measure_load(iterations=2, paths=PATHS)}
    assert set(records) == {"memcpy", "files", "rows-tcp", "rows-shm", "rows-shm-verified"}
    assert records["memcpy"]["gbps"] > 0
    for path in PATHS:
        r = records[path]
        assert r["megabytes"] == 33.59 and r["median_ms"] > 0
        assert abs(r["fraction_of_memcpy"] - r["gbps"] / r["memcpy_gbps"]) < 0.01


def test_a_stack_record_pairs_each_cold_request_with_its_warm_one():
    r = _record(16, cold=[0.030, 0.040, 0.050], warm=[0.020, 0.020, 0.025])
    assert (r["cold_p50_ms"], r["warm_p50_ms"], r["penalty_p50_ms"]) == (40.0, 20.0, 20.0)
    assert r["cold_over_warm_p50"] == 2.0 and r["trials"] == 3


def test_targets_are_computed_from_the_records():
    records = [
        {"part": "load", "path": "memcpy", "gbps": 11.5},
        {"part": "load", "path": "rows-shm", "fraction_of_memcpy": 0.44},
        {"part": "stack", "model": "demo", "rank": 8, "cold_over_warm_p50": 1.16},
        {"part": "stack", "model": "demo", "rank": 64, "cold_over_warm_p50": 1.3},
        {"part": "stack", "model": "random-100m", "rank": 8, "cold_over_warm_p50": 1.02},
    ]
    got = targets(records)
    assert [(t["value"], t["goal"], t["met"]) for t in got] == [
        (1.3, "<= 1.25", False),  # the worst rank decides
        (1.02, "<= 1.25", True),
        (0.44, ">= 0.5", False),
    ]
    assert all(set(t) == {"name", "goal", "value", "met"} for t in got)
    assert targets([r for r in records if r["part"] == "stack"])[-1]["name"].startswith("cold ÷ warm")
