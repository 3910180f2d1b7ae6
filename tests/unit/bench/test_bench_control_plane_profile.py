"""`--cp-profile`'s split: a real cProfile's own time summed by where each function lives."""

from __future__ import annotations

import cProfile
import json

from loraserve.bench.suites.control_plane import profile_split
from loraserve.scheduler.load_index import __file__ as LOAD_INDEX


def _work() -> int:
    total = 0
    for i in range(20_000):
        total += len(json.dumps({"i": i}))  # stdlib json, and its C encoder
    return total


def test_the_split_names_repo_files_stdlib_packages_and_c_functions_with_shares_of_the_whole(tmp_path):
    profile = tmp_path / "p.prof"
    profiler = cProfile.Profile()
    profiler.runcall(_work)
    profiler.dump_stats(profile)
    got = profile_split.split(profile, top=50)
    sources = {s["source"]: s for s in got["sources"]}
    assert "json" in sources and "built-in and C functions" in sources
    assert "tests/unit/bench/test_bench_control_plane_profile.py" in sources  # _work, a file of this repo
    assert abs(sum(s["share"] for s in got["sources"]) - 1.0) < 0.01  # every source fits in top=50
    assert [s["seconds"] for s in got["sources"]] == sorted((s["seconds"] for s in got["sources"]), reverse=True)


def test_sources_of_files_outside_and_inside_the_repo():
    assert profile_split.source("~", "<built-in method builtins.len>") == "built-in and C functions"
    assert profile_split.source("~", "<method 'poll' of 'select.epoll' objects>") == profile_split.IDLE
    assert profile_split.source("/x/lib/python3.11/site-packages/grpc/aio/_server.py") == "grpc"
    assert profile_split.source("/x/lib/python3.11/site-packages/msgspec.py") == "msgspec"
    assert profile_split.source(LOAD_INDEX) == "scheduler/load_index.py"
