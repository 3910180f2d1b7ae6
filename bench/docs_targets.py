"""The docs' tables of targets, generated from the committed results a suite wrote.

A table of a suite's targets is never typed: the docs hold a block

    <!-- targets: docs/abuse/results.json -->
    (generated table)
    <!-- /targets -->

and this module fills it from that file's `targets` (each `{"name", "goal", "value", "met"}`, as
the suite computed it), with the suite, commit and machine the file names under the table.

    python -m loraserve.bench.docs_targets            # rewrite every block in README.md and docs/*.md
    python -m loraserve.bench.docs_targets --check    # exit 1, naming each block that differs

`tests/project/test_docs_targets.py` runs the check, so a docs verdict that differs from its
results file fails the suite. A table whose header has a `met` column outside such a block is
refused by the same check: verdicts come from files, not from hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.settings import add_settings, config_from_args
from loraserve.bench.common.tables import markdown_table
from loraserve.config_cli import setting

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?P<open><!-- targets: (?P<path>\S+) -->\n)(?P<body>.*?)(?P<close><!-- /targets -->)", re.S)
TABLE_HEADER = re.compile(r"^(?P<header>\|.*\|)[ \t]*\n\|[-:| \t]+\|[ \t]*$", re.M)
HEADERS = ("target", "goal", "measured", "met")
VERDICT_COLUMNS = {"met", "verdict"}


@dataclass(frozen=True)
class Stale:
    """A block (or a hand-typed verdict table) in `doc` that the check refuses."""

    doc: str
    what: str


def docs(root: Path = ROOT) -> list[Path]:
    """The Markdown files whose blocks the check covers."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def target_rows(results: dict) -> list[list[str]]:
    """The cells of a results file's targets. Files of the GPU suite's first run name the fields
    `target` and `wanted`; later ones, like every other suite, `name` and `goal`."""
    rows = []
    for t in results.get("targets") or []:
        name = t.get("name", t.get("target"))
        goal = t.get("goal", t.get("wanted"))
        rows.append([cell(name), cell(goal), cell(t.get("value")), {True: "met", False: "missed"}.get(t["met"], "–")])
    return rows


def cell(value: object) -> str:
    """A measured value as the table shows it: 4 significant digits, lists comma-joined."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(cell(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {cell(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|")


def render(path: str, results: dict) -> str:
    """The block's body for results file `path`: the table and where it came from."""
    rows = target_rows(results)
    if not rows:
        raise ValueError(f"{path} has no targets: a targets block needs a results file whose suite computed them")
    about = [f"suite `{results['suite']}`"] if results.get("suite") else []
    if results.get("commit"):
        about.append(f"commit {results['commit']}")
    about.append(machine(results))
    return markdown_table(HEADERS, rows) + f"\n\nComputed by the suite into `{path}` ({'; '.join(about)}).\n"


def machine(results: dict) -> str:
    """The machine a results file came from, in a few words: its GPU, else its CPU and cores. The
    GPU suite's first run named it `environment`; every later file, `machine`."""
    about = results.get("machine") or results.get("environment") or {}
    gpu = about.get("gpu") or about.get("device")
    if gpu:
        return str(gpu)
    cpu = about.get("cpu") or about.get("cpu_model") or "an unnamed machine"
    cores = about.get("cores") or about.get("cpus")
    return f"{cpu}, {cores} cores" if cores else str(cpu)


def load(path: str, root: Path = ROOT) -> dict:
    """The results file a block names, which must lie inside the repository."""
    file = (root / path).resolve()
    if not file.is_relative_to(root.resolve()):
        raise ValueError(f"{path} is outside the repository")
    return json.loads(file.read_text())


def update(text: str, root: Path = ROOT) -> str:
    """`text` with every targets block regenerated from its file."""

    def fill(match: re.Match) -> str:
        return match["open"] + render(match["path"], load(match["path"], root)) + match["close"]

    return BLOCK.sub(fill, text)


def check(root: Path = ROOT) -> list[Stale]:
    """Every block that differs from its file, and every verdict table typed outside a block."""
    stale = []
    for doc in docs(root):
        text = doc.read_text()
        name = str(doc.relative_to(root))
        for match in BLOCK.finditer(text):
            try:
                want = render(match["path"], load(match["path"], root))
            except (OSError, ValueError) as e:
                stale.append(Stale(name, f"{match['path']}: {e}"))
                continue
            if match["body"] != want:
                stale.append(Stale(name, f"the block of {match['path']} differs from the file's targets"))
        outside = BLOCK.sub("", text)
        for table in TABLE_HEADER.finditer(outside):
            if VERDICT_COLUMNS & {c.strip().lower() for c in table["header"].strip("|").split("|")}:
                stale.append(Stale(name, f"a table with a `met` column typed by hand: {table['header']}"))
    return stale


@dataclass(frozen=True)
class DocsTargetsSettings:
    """The command's one option."""

    check: bool = setting(False, "change nothing; exit 1 naming each stale block")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_settings(parser, DocsTargetsSettings)
    args = config_from_args(DocsTargetsSettings, parser.parse_args(argv))
    if args.check:
        stale = check()
        for s in stale:
            print(f"{s.doc}: {s.what}", file=sys.stderr)
        return 1 if stale else 0
    for doc in docs():
        text = doc.read_text()
        try:
            new = update(text)
        except (OSError, ValueError) as e:
            print(f"{doc.relative_to(ROOT)}: {e}", file=sys.stderr)
            return 1
        if new != text:
            doc.write_text(new)
            print(f"updated {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
