"""The benchmark harness keeps its shape: suites are small plug-ins over `bench/common/`.

- `bench/` stays under a ceiling of lines (lowered as the harness shrinks, never raised);
- no file of a suite (`bench/suites/<name>/`) is over `SUITE_FILE_MAX` lines;
- no suite imports another suite: what two suites share lives in `bench/common/`;
- every suite's preset is a `bench/common/preset.py` `Preset`: its FULL and QUICK are instances of one, never dicts.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
SUITES = BENCH / "suites"
BENCH_LINES_MAX = 12_904
SUITE_FILE_MAX = 400


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _suite_files() -> list[Path]:
    return sorted(SUITES.glob("*/*.py"))


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every module an `import` or `from ... import` names (relative imports resolved against nothing)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_bench_stays_under_its_line_ceiling():
    total = sum(_lines(p) for p in BENCH.rglob("*.py"))
    assert total <= BENCH_LINES_MAX, f"bench/ has {total} lines, over its ceiling of {BENCH_LINES_MAX}"


def test_no_suite_file_is_over_the_limit():
    over = {str(p.relative_to(BENCH)): n for p in _suite_files() if (n := _lines(p)) > SUITE_FILE_MAX}
    assert not over, f"suite files over {SUITE_FILE_MAX} lines (split them, or move shared code to common/): {over}"


def test_no_suite_imports_another():
    crossings = []
    for path in _suite_files():
        own = path.parent.name
        for module in _imported_modules(ast.parse(path.read_text())):
            parts = module.split(".")
            if parts[:3] == ["loraserve", "bench", "suites"] and len(parts) > 3 and parts[3] != own:
                crossings.append(f"{path.relative_to(BENCH)} imports {module}")
    assert not crossings, "a suite imports another (share through bench/common/ instead):\n" + "\n".join(crossings)


def test_every_suite_preset_is_the_shared_preset():
    strays = []
    for path in _suite_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Preset", "Plan")):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if "Preset" not in bases and node.name != "Preset":
                    strays.append(f"{path.relative_to(BENCH)}: {node.name}")
    assert not strays, "presets that are not bench/common/preset.py's Preset: " + ", ".join(strays)


def test_full_and_quick_are_preset_instances_not_dicts():
    strays = []
    for path in _suite_files():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                pairs = []
                for t in node.targets:
                    if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(t.elts, node.value.elts, strict=True)
                    else:
                        pairs.append((t, node.value))
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                pairs = [(node.target, node.value if isinstance(node, ast.AnnAssign) else None)]
            else:
                continue
            for target, value in pairs:
                if isinstance(target, ast.Name) and target.id in ("FULL", "QUICK") and not isinstance(value, ast.Call):
                    strays.append(f"{path.relative_to(BENCH)}:{node.lineno} {target.id}")
    assert not strays, "presets that are not a Preset class's instance (a dict?): " + ", ".join(strays)
