"""Contracts below the roles, read from the source (no import runs; import statements are found line by line
and each parsed on its own, which reads the whole project well within a second):

- the shared package (`loraserve/`) never imports a role or the demo, at any level;
- the project's modules import each other without a cycle (imports that run: module level and inside
  functions; `if TYPE_CHECKING:` blocks, which never run, are left out);
- an adapter's rows in the pool (the layout rule, the packed rows' format) are one shared module's,
  `loraserve/pool_rows.py`, which every user imports them from, beside at most one role-private rows module;
- the emulated runner and the adaptive strategy are subpackages, and their old flat modules are gone;
- a module name means one thing: the gateway and the scheduler share only their entry-point names.
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {  # folder -> the package it is installed as (pyproject.toml's package-dir)
    "loraserve": "loraserve",
    "gateway": "loraserve.gateway",
    "scheduler": "loraserve.scheduler",
    "adapter_store": "loraserve.adapter_store",
    "worker": "loraserve.worker",
    "launcher": "loraserve.launcher",
    "kernels": "loraserve.kernels",
    "bench": "loraserve.bench",
    "demo": "loraserve.demo",
}
ROLE_PACKAGES = tuple(f"{name}." for folder, name in PACKAGES.items() if folder != "loraserve")
CONTRACT = "loraserve.pool_rows"
CONTRACT_NAMES = {"AdapterLayout", "ModuleBlock", "block_offsets", "adapter_layout", "RowsSpec", "pack_rows"}
ROWS_USERS = {  # the roles' modules that lay out, pack or check rows
    "loraserve.worker.pool_layout",
    "loraserve.worker.adapter_rows",
    "loraserve.adapter_store.packing",
    "loraserve.adapter_store.client",
}
SUBPACKAGES = {
    "worker/emulated": ("runner.py", "tokens.py"),
    "scheduler/adaptive": ("planner.py", "strategy.py"),
}
GONE = (
    "worker/emulated_runner.py",
    "worker/emulated_tokens.py",
    "scheduler/adaptive.py",
    "scheduler/adaptive_strategy.py",
)
ENTRY_POINT_NAMES = {"__init__", "config", "main", "metrics", "service", "settings"}  # "this role's ...", each role


@functools.cache
def modules() -> dict[str, Path]:
    """Every project module's dotted name -> its file."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


_STATEMENT = re.compile(r"^[ \t]*(?:from[ \t]+[\w.]+[ \t]+import[ \t]+(?:\([^)]*\)|[^\n]*)|import[ \t]+[^\n]*)", re.M)
_GUARD = re.compile(r"^([ \t]*)if[ \t]+(?:typing\.)?TYPE_CHECKING[ \t]*:[^\n]*\n(?:\1[ \t]+[^\n]*\n|[ \t]*\n)*", re.M)
_LONG_STRING = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'')  # docstrings, examples in text
_TOP_LEVEL_DEF = re.compile(r"^(?:class|def)[ \t]+(\w+)", re.M)


@functools.cache
def source(name: str) -> str:
    return modules()[name].read_text()


@functools.cache
def import_statements(name: str, runtime_only: bool) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """The module's import statements at any level (not in triple-quoted text); without `if TYPE_CHECKING:`
    blocks when `runtime_only`. A line that only looks like one does not parse as one and is left out."""
    text = _LONG_STRING.sub("", source(name))
    text = _GUARD.sub("", text) if runtime_only else text
    found = []
    for match in _STATEMENT.finditer(text):
        try:
            found += ast.parse(match[0].strip()).body
        except SyntaxError:
            continue
    return tuple(node for node in found if isinstance(node, ast.Import | ast.ImportFrom))


def top_level_definitions(name: str) -> set[str]:
    return set(_TOP_LEVEL_DEF.findall(source(name)))


def _project_module(name: str) -> str | None:
    """The project module `name` is, or is in (an imported name's module); None outside the project."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def imported(name: str, runtime_only: bool = False) -> set[str]:
    """The project modules `name` imports (at any level; only what runs when `runtime_only`)."""
    out = set()
    for node in import_statements(name, runtime_only):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            targets = [f"{base}.{alias.name}" for alias in node.names]
        out.update(m for m in map(_project_module, targets) if m is not None and m != name)
    return out


def import_graph() -> dict[str, set[str]]:
    return {name: imported(name, runtime_only=True) for name in modules()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start, targets in graph.items():
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(targets))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_shared_package_imports_no_role_and_not_the_demo():
    shared = [name for name, path in modules().items() if path.is_relative_to(ROOT / "loraserve")]
    wrong = sorted(
        f"{name} imports {target}" for name in shared for target in imported(name) if target.startswith(ROLE_PACKAGES)
    )
    assert not wrong, "the shared package must not depend on a role or the demo:\n" + "\n".join(wrong)


def test_the_project_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_rows_contract_is_one_shared_module():
    rows_modules = sorted(name for name in modules() if "rows" in name.rpartition(".")[2])
    shared = [name for name in rows_modules if not name.startswith(ROLE_PACKAGES)]
    assert shared == [CONTRACT], f"the shared rows module is {CONTRACT} alone, not {shared}"
    assert len(rows_modules) <= 2, f"one contract and at most one role-private rows module, not {rows_modules}"
    defined = top_level_definitions(CONTRACT) & CONTRACT_NAMES
    assert defined == CONTRACT_NAMES, f"{CONTRACT} lacks {sorted(CONTRACT_NAMES - defined)}"


def test_the_roles_take_the_rows_contract_from_it():
    wrong = []
    for name in modules():
        if name == CONTRACT:
            continue
        wrong += [f"{name} defines its own {d}" for d in sorted(top_level_definitions(name) & CONTRACT_NAMES)]
        for node in import_statements(name, runtime_only=False):
            if isinstance(node, ast.ImportFrom) and node.module != CONTRACT:
                wrong += [f"{name} takes {a.name} from {node.module}" for a in node.names if a.name in CONTRACT_NAMES]
    wrong += [f"{user} does not import {CONTRACT}" for user in sorted(ROWS_USERS) if CONTRACT not in imported(user)]
    assert not wrong, "\n".join(wrong)


def test_the_emulated_runner_and_the_adaptive_strategy_are_subpackages():
    installed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for folder, files in SUBPACKAGES.items():
        for file in ("__init__.py", *files):
            assert (ROOT / folder / file).is_file(), f"{folder}/{file} is missing"
        assert "loraserve." + folder.replace("/", ".") in installed, f"pyproject.toml does not install {folder}"
    present = [path for path in GONE if (ROOT / path).exists()]
    assert not present, f"moved into a subpackage, yet still here: {present}"


def test_the_gateway_and_the_scheduler_share_only_entry_point_module_names():
    def names(folder: str) -> set[str]:
        return {path.stem for path in (ROOT / folder).glob("*.py")}

    shared = names("gateway") & names("scheduler") - ENTRY_POINT_NAMES
    assert not shared, f"one name, two meanings: gateway/ and scheduler/ both have {sorted(shared)}"
