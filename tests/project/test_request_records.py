"""One request record, validated on construction (a fast scan of the shipped code and protos, nothing imported).

- Few records on a request's way carry its fields: each edge maps its body to one struct
  (`gateway/generation_request.py`), the gateway builds the scheduler's `RequestSpec` from it, and the
  records after that (the scheduler's `QueuedRequest`, the engine's `Request`) hold the spec, not copies
  of its fields. A record "carries request fields" when it declares at least `MIN_SHARED` of
  `REQUEST_FIELDS` (a class's annotated attributes: dataclasses, msgspec Structs, pydantic bodies; a proto
  message's fields that are not deprecated). Per edge, its own records and those of the shared path
  count: at most `MAX_RECORDS`. The sampling parameters' record, which the others hold whole, and the
  placement model's size query are not request records (`NOT_RECORDS`).
- A request field's bound is written once: no literal bound (`86400`, ...) appears at two bound sites
  (a `msgspec.Meta`/pydantic `Field` bound, a `MAX_*`/`MIN_*` constant, a `max_*`/`min_*` default) whose
  subjects share a word (`ttft_slo_s`'s `le=86400.0` and `MAX_TTFT_SLO_S = 86400.0`).

`test_the_measures_can_fail` shows each check catching a violation.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from collections import defaultdict
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUEST_FIELDS = frozenset(
    {
        "prompt_ids",
        "prompt_text",
        "prompt_len",
        "max_new_tokens",
        "stop_token_ids",
        "sampling",
        "cache_salt",
        "prefill_group",
        "ttft_slo_s",
        "client_request_id",
        "reply_to",
        "request_key",
    }
)
MIN_SHARED = 2
MAX_RECORDS = 3
# Where each edge's own records are, and the path both share (a proto by its file, code by its folder).
EDGES = {
    "grpc": ("proto/loraserve/v1/gateway.proto",),
    "http": ("gateway/http/",),
    "offline": ("worker/engine.py",),  # the engine's offline API (`Engine.generate`)
}
SHARED = ("proto/loraserve/v1/scheduler.proto", "gateway/", "loraserve/", "scheduler/", "worker/")
CLIENT_SIDE = ("loraserve/client/",)  # the Python client library: the caller's side of the gRPC edge
# Classes that declare such fields without being a request's record, and why.
NOT_RECORDS = {
    "loraserve/params.py:SamplingParams": "the sampling parameters' one record: request records hold it whole",
    "scheduler/placement.py:Demand": "the cost model's query of a size (a request's, or a typical one for a hint)",
}
BOUND_KEYWORDS = frozenset({"ge", "le", "gt", "lt", "min_length", "max_length"})
GENERIC_WORDS = frozenset({"max", "min", "len", "length", "chars", "bytes", "s", "of", "the"})
_MESSAGE = re.compile(r"^message (\w+) \{(.*?)^\}", re.M | re.S)
_FIELD = re.compile(r"^\s+(?:repeated |optional )?[\w.<>, ]+? (\w+) = \d+( \[deprecated = true\])?;", re.M)


@functools.cache  # read once for the module's checks
def shipped_sources() -> dict[str, str]:
    """The shipped Python files of the request's path (generated stubs aside) and the protos, by path."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.proto"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    code = [p for p in listed if p.startswith(SHARED) and not p.startswith(CLIENT_SIDE) and "/v1/" not in p]
    paths = code + [p for p in listed if p.endswith(".proto")]
    return {p: (ROOT / p).read_text() for p in paths if (ROOT / p).exists()}


def records(sources: dict[str, str]) -> dict[str, set[str]]:
    """Each record that declares request fields (`path:Name`), with the ones it declares."""
    found = {}
    for path, text in sources.items():
        if path.endswith(".proto"):
            for name, body in _MESSAGE.findall(text):
                fields = {f for f, deprecated in _FIELD.findall(body) if not deprecated}
                found[f"{path}:{name}"] = fields & REQUEST_FIELDS
            continue
        for cls in (n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)):
            fields = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            found[f"{path}:{cls.name}"] = fields & REQUEST_FIELDS
    return {name: fields for name, fields in found.items() if len(fields) >= MIN_SHARED and name not in NOT_RECORDS}


def per_edge(found: dict[str, set[str]]) -> dict[str, list[str]]:
    """The records each edge's requests pass through: its own, then the shared path's."""
    own = {edge: [r for r in found if r.startswith(places)] for edge, places in EDGES.items()}
    mine = {r for rs in own.values() for r in rs}
    shared = [r for r in found if r not in mine and r.startswith(SHARED)]
    return {edge: rs + shared for edge, rs in own.items()}


def bound_sites(sources: dict[str, str]) -> list[tuple[float, str, str]]:
    """Every literal bound: (value, its subject's name, where)."""
    sites = []
    for path, text in sources.items():
        if not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(text)):
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            subject = getattr(target, "id", "")
            value = getattr(node, "value", None)
            if subject.lower().startswith(("max_", "min_")) and _number(value) is not None:
                sites.append((_number(value), subject, f"{path}:{node.lineno}"))
            typed = [value, getattr(node, "annotation", None)] if subject else []
            for call in (c for expr in typed if isinstance(expr, ast.expr) for c in ast.walk(expr)):
                if isinstance(call, ast.Call) and _name(call.func) in ("Meta", "Field"):
                    for keyword in call.keywords:
                        if keyword.arg in BOUND_KEYWORDS and _number(keyword.value) is not None:
                            sites.append((_number(keyword.value), subject, f"{path}:{call.lineno}"))
    return sites


def bounds_written_twice(sites: list[tuple[float, str, str]]) -> list[str]:
    """Pairs of sites with the same value and subjects sharing a word: one bound, written twice."""
    by_value = defaultdict(list)
    for value, subject, where in sites:
        if value not in (0, 1):  # "positive", "non-empty": not bounds of their own
            by_value[value].append((subject, where))
    twice = []
    for value, found in by_value.items():
        for (a, at), (b, bt) in combinations(found, 2):
            if _words(a) & _words(b):
                twice.append(f"{value}: {a} ({at}) and {b} ({bt})")
    return twice


def _number(node: ast.AST | None) -> float | None:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    return None


def _name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _words(name: str) -> set[str]:
    """The words of a name, snake_case or CamelCase (`TtftSlo`, `MAX_TTFT_SLO_S`: ttft, slo)."""
    return {w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)} - GENERIC_WORDS


def test_each_edge_passes_its_request_through_at_most_three_records():
    edges = per_edge(records(shipped_sources()))
    assert edges["grpc"] and edges["http"]  # the scan found the records it counts
    for edge, found in edges.items():
        assert len(found) <= MAX_RECORDS, f"{edge}: {len(found)} records carry request fields:\n" + "\n".join(found)


def test_no_bound_is_written_twice():
    twice = bounds_written_twice(bound_sites(shipped_sources()))
    assert not twice, "bounds written twice:\n" + "\n".join(twice)


def test_the_measures_can_fail():
    """Each check sees a violation when there is one: a record copying a spec's fields, a deprecated
    proto field that no longer counts, a bound repeated under another name."""
    sources = {
        "proto/loraserve/v1/gateway.proto": "message A {\n  string cache_salt = 1;\n  double ttft_slo_s = 2;\n}\n"
        "message B {\n  string cache_salt = 1 [deprecated = true];\n  double ttft_slo_s = 2;\n}\n",
        "scheduler/copy.py": "class Q:\n    prompt_len: int\n    reply_to: str\n    ttft_slo_s: float\n"
        "MAX_TTFT_SLO_S = 86400.0\n",
        "worker/r.py": "class R:\n    prompt_ids: list\n    sampling: object\n",
        "gateway/http/d.py": "class D:\n    cache_salt: str\n    prompt_text: str\n",
        "loraserve/spec.py": "class S:\n    ttft_slo_s: Annotated[float, Meta(le=86400.0)]\n"
        "    cache_salt: Annotated[str, Meta(max_length=64)]\n",
    }
    edges = per_edge(records(sources))
    assert sorted(edges["grpc"]) == sorted(
        ["proto/loraserve/v1/gateway.proto:A", "scheduler/copy.py:Q", "worker/r.py:R", "loraserve/spec.py:S"]
    )
    assert len(edges["http"]) == 4
    twice = bounds_written_twice(bound_sites(sources))
    assert len(twice) == 1 and "MAX_TTFT_SLO_S" in twice[0] and "ttft_slo_s" in twice[0]
