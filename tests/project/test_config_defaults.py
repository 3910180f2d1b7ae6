"""Each default is written once, and each role has one configuration tree (a fast scan of the shipped code).

- An address literal (`tcp://...`, `127.0.0.1:7100`, `http://...`) appears once in the shipped code: a default
  two roles share (the store's data address, which it binds and workers connect to) is one named constant
  (`loraserve/shared_defaults.py`) that both import.
- No configuration field repeats another configuration class's default for a field of the same name (a unit
  suffix aside: `drain_timeout` and `drain_timeout_s` are one setting).
- No configuration class in a role copies another's fields (the same names, or defaults read off the other
  class, as `setting(Other.field, ...)`): a role's settings and the configuration its code reads are one tree.

Each check runs on parsed sources, so `test_each_check_fails_on_a_duplicate` shows it catching one.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from collections import defaultdict
from itertools import permutations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("loraserve/", "gateway/", "scheduler/", "adapter_store/", "worker/", "launcher/")
SHIPPED = (*ROLES, "kernels/", "bench/", "demo/")
HOST = r"(?:\d{1,3}(?:\.\d{1,3}){3}|localhost|\[[0-9a-f:]+\])"
ADDRESS = re.compile(rf"(?:[a-z]+://[^\s:/]+(?::\d{{1,5}})?(?:/\S*)?|{HOST}:\d{{2,5}})")
CONFIG_NAME = re.compile(r"(Config|Settings|Limits)$")
SETTING_CALLS = {"setting", "directory_setting"}
Source = tuple[str, ast.Module]


@functools.cache  # parsed once for the module's checks
def shipped_sources() -> list[Source]:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    paths = [p for p in tracked.stdout.split() if p.startswith(SHIPPED) and "/v1/" not in p]
    return [(p, ast.parse((ROOT / p).read_text(), p)) for p in paths if (ROOT / p).exists()]


def repeated_addresses(sources: list[Source]) -> dict[str, list[str]]:
    """Each address literal written more than once, with where."""
    where = defaultdict(list)
    for path, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ADDRESS.fullmatch(node.value):
                where[node.value].append(f"{path}:{node.lineno}")
    return {address: places for address, places in where.items() if len(places) > 1}


def config_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """The configuration dataclasses of a module: named *Config, *Settings or *Limits, or with `setting` fields."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(_name(d) == "dataclass" for d in node.decorator_list)
        and (CONFIG_NAME.search(node.name) or any(_setting_call(f.value) for f in _fields(node)))
    ]


def repeated_defaults(sources: list[Source]) -> dict[str, list[str]]:
    """Each (field, default) that two configuration classes of the roles both write as a literal, with where."""
    where = defaultdict(list)
    for path, tree in (source for source in sources if source[0].startswith(ROLES)):
        for cls in config_classes(tree):
            for f in _fields(cls):
                literal = _literal(_default(f.value))
                if literal is not None:
                    where[f"{_unit_free(f.target.id)} = {literal}"].append(f"{path}:{cls.name}")
    return {key: places for key, places in where.items() if len(set(places)) > 1}


def copied_classes(sources: list[Source]) -> list[str]:
    """Configuration classes of one role that copy two or more fields of another class of that role: a field
    whose default is read off the other class, or one of the same name (but a unit suffix) and default."""
    found = []
    for role in ROLES:
        classes = [cls for path, tree in sources if path.startswith(role) for cls in config_classes(tree)]
        for a, b in permutations(classes, 2):
            theirs = {_unit_free(f.target.id): _literal(_default(f.value)) for f in _fields(b)}
            copies = [
                f.target.id
                for f in _fields(a)
                if _reads_class(_default(f.value), b.name)
                or (_literal(_default(f.value)) or "unset") == theirs.get(_unit_free(f.target.id))
            ]
            if len(copies) >= 2:
                found.append(f"{role}{a.name} copies {b.name}: {', '.join(copies)}")
    return found


def _fields(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    return [
        s
        for s in cls.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and "ClassVar" not in ast.unparse(s)
    ]


def _name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _setting_call(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Call) and _name(node) in SETTING_CALLS


def _default(node: ast.expr | None) -> ast.expr | None:
    """A field's default expression: `= value`, or a `setting(value, ...)`'s first argument."""
    if _setting_call(node):
        return node.args[0] if node.args else None
    if isinstance(node, ast.Call) and _name(node) == "field":
        return next((k.value for k in node.keywords if k.arg == "default"), None)
    return node


def _literal(node: ast.expr | None) -> str | None:
    """A default written as a literal (None, an empty tuple and a bare bool aside), or a Path of one."""
    if isinstance(node, ast.Call) and _name(node) == "Path" and node.args:
        node = node.args[0]
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        return ast.unparse(node)
    if isinstance(node, ast.Constant) and node.value is not None:
        return repr(node.value)
    return None


def _reads_class(node: ast.expr | None, name: str) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name


def _unit_free(name: str) -> str:
    return name.removesuffix("_s")


def test_every_address_literal_is_written_once():
    assert repeated_addresses(shipped_sources()) == {}, "name a shared address once (loraserve/shared_defaults.py)"


def test_no_configuration_repeats_another_ones_default():
    assert repeated_defaults(shipped_sources()) == {}, "a default two roles share is a constant both import"


def test_each_role_has_one_configuration_tree():
    assert copied_classes(shipped_sources()) == [], "nest the configuration, or use it, rather than copy its fields"


WORKER = """
@dataclass(frozen=True)
class WorkerConfig:
    store_address: str = setting("tcp://127.0.0.1:7301", "the store's data address")
    drain_timeout_s: float = setting(30.0, "seconds to drain", flag="--drain-timeout")
"""
COPY = """
@dataclass(frozen=True)
class WorkerSettings:
    store_address: str = setting(WorkerConfig.store_address, "the store's data address")
    drain_timeout: float = setting(30.0, "seconds to drain")
"""
STORE = """
@dataclass(frozen=True)
class StoreConfig:
    data_address: str = setting("tcp://127.0.0.1:7301", "where workers fetch from")
"""


def test_each_check_fails_on_a_duplicate():
    """The checks above, on sources that write a default twice: a second address, the same timeout in two
    classes, and a settings class beside the config whose fields it copies."""

    def parsed(**sources: str) -> list[Source]:
        return [(f"{role}/config.py", ast.parse(text)) for role, text in sources.items()]

    assert repeated_addresses(parsed(worker=WORKER, adapter_store=STORE)) == {
        "tcp://127.0.0.1:7301": ["worker/config.py:4", "adapter_store/config.py:4"]
    }
    assert repeated_addresses(parsed(worker=WORKER)) == {}
    assert list(repeated_defaults(parsed(worker=WORKER + COPY))) == ["drain_timeout = 30.0"]
    assert copied_classes(parsed(worker=WORKER + COPY)) == [
        "worker/WorkerSettings copies WorkerConfig: store_address, drain_timeout"
    ]
    assert copied_classes(parsed(worker=WORKER, adapter_store=STORE)) == []
