"""The docs' tables of targets are the verdicts the suites wrote into their committed results."""

from __future__ import annotations

import json
from pathlib import Path

from loraserve.bench import docs_targets

RESULTS = {
    "suite": "demo",
    "machine": {"cpu": "Test CPU", "cores": 2},
    "commit": "abc1234",
    "records": [],
    "targets": [
        {"name": "throughput ratio", "goal": ">= 2", "value": 2.34567, "met": True},
        {"name": "p99 (s)", "goal": "<= 0.5", "value": 0.75, "met": False},
        {"name": "not reached", "goal": "< 1", "value": None, "met": None},
    ],
}


def _tree(tmp_path: Path, doc: str, results: dict = RESULTS) -> Path:
    (tmp_path / "docs" / "demo").mkdir(parents=True)
    (tmp_path / "docs" / "demo" / "results.json").write_text(json.dumps(results))
    (tmp_path / "docs" / "benchmarks.md").write_text(doc)
    (tmp_path / "README.md").write_text("# readme\n")
    return tmp_path


def test_every_targets_block_in_the_docs_matches_its_committed_results():
    stale = docs_targets.check()
    assert not stale, "\n".join(f"{s.doc}: {s.what}" for s in stale) + (
        "\nrun `python -m loraserve.bench.docs_targets` to regenerate the blocks from the results"
    )


def test_a_block_is_filled_from_its_file_with_each_verdict_as_the_suite_computed_it(tmp_path):
    root = _tree(tmp_path, "intro\n<!-- targets: docs/demo/results.json -->\nold text\n<!-- /targets -->\nafter\n")
    [stale] = docs_targets.check(root)
    assert "differs" in stale.what
    text = docs_targets.update((root / "docs" / "benchmarks.md").read_text(), root)
    assert "| throughput ratio | >= 2 | 2.346 | met |" in text
    assert "| p99 (s) | <= 0.5 | 0.75 | missed |" in text
    assert "| not reached | < 1 | – | – |" in text
    assert "commit abc1234" in text and "Test CPU, 2 cores" in text
    assert text.startswith("intro\n") and text.endswith("<!-- /targets -->\nafter\n")
    (root / "docs" / "benchmarks.md").write_text(text)
    assert docs_targets.check(root) == []


def test_a_verdict_changed_in_the_file_makes_the_docs_stale(tmp_path):
    root = _tree(tmp_path, "<!-- targets: docs/demo/results.json -->\n<!-- /targets -->\n")
    doc = root / "docs" / "benchmarks.md"
    doc.write_text(docs_targets.update(doc.read_text(), root))
    flipped = json.loads(json.dumps(RESULTS))
    flipped["targets"][0]["met"] = False
    (root / "docs" / "demo" / "results.json").write_text(json.dumps(flipped))
    assert [s.what for s in docs_targets.check(root)] == [
        "the block of docs/demo/results.json differs from the file's targets"
    ]


def test_a_verdict_table_typed_by_hand_is_refused(tmp_path):
    root = _tree(tmp_path, "| target | goal | measured | met |\n|---|---|---|---|\n| x | 1 | 1 | met |\n")
    [stale] = docs_targets.check(root)
    assert "typed by hand" in stale.what
    plain = "| role | metrics |\n|---|---|\n| gateway | met by a row, not a column |\n"
    (root / "docs" / "benchmarks.md").write_text(plain)
    assert docs_targets.check(root) == []


def test_a_block_whose_file_has_no_targets_or_is_missing_is_refused(tmp_path):
    root = _tree(tmp_path, "<!-- targets: docs/demo/results.json -->\n<!-- /targets -->\n", {**RESULTS, "targets": []})
    [stale] = docs_targets.check(root)
    assert "has no targets" in stale.what
    (root / "docs" / "benchmarks.md").write_text("<!-- targets: docs/demo/absent.json -->\n<!-- /targets -->\n")
    [stale] = docs_targets.check(root)
    assert "absent.json" in stale.what
    (root / "docs" / "benchmarks.md").write_text("<!-- targets: ../outside.json -->\n<!-- /targets -->\n")
    (root.parent / "outside.json").write_text(json.dumps(RESULTS))
    [stale] = docs_targets.check(root)
    assert "outside the repository" in stale.what
