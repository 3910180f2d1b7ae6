"""The worker's layout: decisions in a core without I/O, a thin loop around it, no pass-through layers,
and no class in the project too large to read (all read with `ast`, nothing imported).

- `worker/service.py`, the loop that feeds the core and carries out its effects, stays short;
- the core (`worker/core.py`) and the pure objects it owns import no socket, thread or wire codec;
- few methods in `worker/` only hand their arguments on to another object (`forwards`);
- no class in the repo's own code is over `MAX_CLASS_LINES` lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker"
TOP_LEVEL = ("loraserve", "gateway", "scheduler", "adapter_store", "worker", "launcher", "kernels", "bench", "demo")
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
MAX_SERVICE_LINES = 150
MAX_FORWARDS = 6
MAX_CLASS_LINES = 250
CORE_MODULES = ("core.py", "effects.py", "parked.py", "replies.py", "tracked.py")
IO_MODULES = (
    "zmq",
    "threading",
    "socket",
    "queue",
    "asyncio",
    "selectors",
    "loraserve.sockets",
    "loraserve.worker.io_thread",
)
WIRE_CODEC = ("encode", "decode", "encode_frames")  # loraserve.wire's (de)serializers: I/O-side only


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _methods(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        yield from (n for n in cls.body if isinstance(n, ast.FunctionDef))


def _is_self_chain(node: ast.expr) -> bool:
    """`self.x.y...` with at least one attribute between `self` and the end."""
    depth = 0
    while isinstance(node, ast.Attribute):
        node, depth = node.value, depth + 1
    return isinstance(node, ast.Name) and node.id == "self" and depth >= 2


def _param_names(fn: ast.FunctionDef) -> list[str]:
    args = fn.args
    return (
        [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs][1:]
        + ([args.vararg.arg] if args.vararg else [])
        + ([args.kwarg.arg] if args.kwarg else [])
    )


def is_forward(fn: ast.FunctionDef) -> bool:
    """A method whose whole body (a docstring aside) is `return self.x.y(<its own parameters>)` or
    `self.x.y(<its own parameters>)`, or a property returning `self.x.y`."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1:
        return False
    stmt = body[0]
    value = stmt.value if isinstance(stmt, (ast.Return, ast.Expr)) else None
    if value is None:
        return False
    if any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
        return _is_self_chain(value)
    if not (isinstance(value, ast.Call) and _is_self_chain(value.func)):
        return False
    passed = [a.value if isinstance(a, ast.Starred) else a for a in value.args]
    passed += [k.value for k in value.keywords]
    names = [a.id for a in passed if isinstance(a, ast.Name)]
    return len(names) == len(passed) and names == _param_names(fn)


def forwards(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        found += [f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}" for fn in _methods(_tree(path)) if is_forward(fn)]
    return found


def class_sizes(roots: tuple[str, ...] = TOP_LEVEL) -> dict[str, int]:
    sizes = {}
    for top in roots:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(GENERATED) or ".venv" in path.parts:
                continue
            for cls in (n for n in ast.walk(_tree(path)) if isinstance(n, ast.ClassDef)):
                sizes[f"{path.relative_to(ROOT)}:{cls.name}"] = cls.end_lineno - cls.lineno + 1
    return sizes


def io_imports(path: Path) -> list[str]:
    """What `path` imports that does I/O: a socket or thread module, the worker's I/O thread, or the wire's codec."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_io(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _is_io(node.module):
                found.append(node.module)
            elif node.module == "loraserve.wire":
                found += [f"loraserve.wire.{a.name}" for a in node.names if a.name in WIRE_CODEC]
            else:
                found += [f"{node.module}.{a.name}" for a in node.names if _is_io(f"{node.module}.{a.name}")]
    return found


def _is_io(module: str) -> bool:
    return module.split(".", maxsplit=1)[0] in IO_MODULES or module in IO_MODULES


def test_the_worker_service_is_a_thin_loop():
    lines = len((WORKER / "service.py").read_text().splitlines())
    assert lines <= MAX_SERVICE_LINES, f"worker/service.py has {lines} lines (at most {MAX_SERVICE_LINES})"


def test_few_methods_in_the_worker_only_forward():
    found = forwards(WORKER)
    assert len(found) <= MAX_FORWARDS, f"{len(found)} one-line forwards (at most {MAX_FORWARDS}):\n" + "\n".join(found)


def test_the_worker_core_does_no_io():
    for name in CORE_MODULES:
        assert io_imports(WORKER / name) == [], f"worker/{name} imports I/O: {io_imports(WORKER / name)}"


def test_no_class_is_too_large():
    sizes = class_sizes()
    assert len(sizes) > 100  # every top-level folder was read
    over = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {over}"


def test_the_measures_can_fail(tmp_path):
    """Each check sees a violation when there is one."""
    forward = ast.parse("class A:\n    def f(self, x):\n        return self.b.f(x)\n").body[0].body[0]
    other = ast.parse("class A:\n    def f(self, x):\n        return self.b.f(x + 1)\n").body[0].body[0]
    prop = ast.parse("class A:\n    @property\n    def f(self):\n        return self.b.f\n").body[0].body[0]
    assert is_forward(forward) and is_forward(prop) and not is_forward(other)
    (tmp_path / "m.py").write_text(
        "import zmq\nfrom loraserve.wire import Tokens, decode\nimport threading\n"
        "from loraserve.worker import io_thread\n"
    )
    assert io_imports(tmp_path / "m.py") == ["zmq", "loraserve.wire.decode", "threading", "loraserve.worker.io_thread"]
