"""The check a sandbox child runs (`gateway/constraint_check.py`) with the limits of `loraserve/structured.py`.

In this process (none of these crashes llguidance; `test_constraint_sandbox.py` has the ones that do),
with the demo model's tokenizer: every constraint the test suite and the benchmarks use, the tool
grammars the HTTP edge builds, and the largest choice the size bound allows pass, each well under a
second; the shapes that once wedged a worker (nested counted repetition, 3,000 alternatives, a
1,000-rule chain) are refused naming the field, within a second too.
"""

from __future__ import annotations

import json
import time

import pytest
from test_openai_http import SCHEMA as HTTP_SCHEMA
from test_openai_http import TIME, WEATHER
from test_structured_output import CONSTRAINTS
from test_tool_parsers import SCHEMAS

from loraserve.bench.suites.structured.suite import GRAMMARS
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidRequestError
from loraserve.gateway.constraint_check import check_constraint
from loraserve.gateway.http.tool_calling import ToolChoice
from loraserve.gateway.tool_parsers import parser_named
from loraserve.structured import ll_tokenizer
from loraserve.tokenizer import Tokenizer

BOUND_S = 2.0  # typically 0.2 s at most (the largest choice, the refusals); room for a busy machine
TOOLS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
MANY_TOOLS = {
    f"tool_{i}": {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 30}, "b": {"type": "integer"}, "c": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    for i in range(20)
}
RICH = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "when": {"type": "string", "format": "date-time"},
        "email": {"type": "string", "format": "email"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "price": {"type": "number", "minimum": 0, "maximum": 1e6},
        "tags": {"type": "array", "items": {"enum": [f"t{i}" for i in range(300)]}, "maxItems": 20},
        "bio": {"type": "string", "maxLength": 2000},
    },
    "required": ["id", "code"],
    "additionalProperties": False,
}


def tool_constraint(mode: str, functions: dict, parser: str | None = None):
    name = next(iter(functions)) if mode == "function" else None
    tools = ToolChoice(mode, functions, name=name, parser=parser and parser_named(parser), strict=parser is not None)
    constraint = tools.constraint()
    return constraint.kind, constraint.value


LEGITIMATE = {
    **{f"numerics {kind}": (kind, value) for kind, value in CONSTRAINTS.items()},
    **{f"bench {name}": grammar for name, grammar in GRAMMARS.items()},
    "http schema": ("json_schema", json.dumps(HTTP_SCHEMA)),
    "rich schema": ("json_schema", RICH),
    "gbnf": ("grammar", 'root ::= "yes" | "no" | [0-9]+'),
    "1,024 choices of 122 bytes (the size bound)": ("choice", ["x" * 118 + f"{i:04d}" for i in range(1024)]),
    "required tools": tool_constraint("required", TOOLS),
    "a named tool": tool_constraint("function", TOOLS),
    "hermes strict tools": tool_constraint("auto", TOOLS, "hermes"),
    "llama3 strict tools": tool_constraint("auto", SCHEMAS, "llama3_json"),
    "20 required tools": tool_constraint("required", MANY_TOOLS),
    "20 hermes strict tools": tool_constraint("auto", MANY_TOOLS, "hermes"),
}
HOSTILE = {
    "nested counted repetition": ("regex", "(x{1000}){1000}", "lexer"),
    "three levels of it": ("regex", "((a{100}){100}){100}", "lexer"),
    "3,000 alternatives": ("grammar", "start: " + " | ".join(f'"t{i}"' for i in range(3000)), "items"),
    "a chain of 1,000 rules": (
        "grammar",
        "\n".join(["start: r0", *(f'r{i}: r{i + 1} | "x{i}"' for i in range(1000)), 'r1000: "end"']),
        "items",
    ),
    "JSON 1,000 deep": ("json_schema", '{"items": ' * 1000 + "{}" + "}" * 1000, "nested"),
}


@pytest.fixture(scope="module")
def tokenizer():
    model = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
    return ll_tokenizer(model.to_json(), model.vocab_size, list(model.eos_token_ids))


@pytest.mark.parametrize("name", sorted(LEGITIMATE))
def test_legitimate_constraints_pass_well_under_a_second(tokenizer, name):
    kind, value = LEGITIMATE[name]
    started = time.monotonic()
    assert check_constraint(tokenizer, kind, value, "guided_json")
    assert time.monotonic() - started < BOUND_S


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_constraints_that_wedged_a_worker_are_refused_in_time(tokenizer, name):
    kind, value, words = HOSTILE[name]
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as caught:
        check_constraint(tokenizer, kind, value, "sampling.structured_output.regex")
    assert caught.value.field == "sampling.structured_output.regex" and words in str(caught.value)
    assert time.monotonic() - started < BOUND_S
