"""`make test` runs the test folders in two groups (the Makefile's PARALLEL_TESTS on pytest-xdist workers,
then SERIAL_TESTS alone): between them the groups name every folder of tests/ that holds tests, each once,
so that a new folder is never left out of the run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()


def _folders(variable: str) -> list[str]:
    match = re.search(rf"^{variable}\s*:?=(.*)$", MAKEFILE, re.MULTILINE)
    assert match, f"the Makefile has no {variable}"
    return match.group(1).split()


def _recipe(target: str) -> str:
    match = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", MAKEFILE, re.MULTILINE)
    assert match, f"the Makefile has no {target} target"
    return match.group(1)


def test_the_two_groups_cover_every_test_folder_once():
    parallel, serial = _folders("PARALLEL_TESTS"), _folders("SERIAL_TESTS")
    named = parallel + serial
    assert len(named) == len(set(named)), f"a folder is in both groups or twice in one: {named}"
    holding_tests = {f"tests/{p.relative_to(ROOT / 'tests').parts[0]}" for p in (ROOT / "tests").glob("*/**/test_*.py")}
    assert set(named) == holding_tests, f"folders with tests: {sorted(holding_tests)}; the Makefile names {named}"
    assert "tests/stack" in serial  # real processes and latency bounds: never beside another test


def test_make_test_runs_both_groups_and_fails_if_either_fails():
    recipe = _recipe("test")
    assert "-n $(TEST_WORKERS)" in recipe and "$(PARALLEL_TESTS)" in recipe and "$(SERIAL_TESTS)" in recipe
    assert recipe.count("|| status=$$?") == 2 and "exit $$status" in recipe
