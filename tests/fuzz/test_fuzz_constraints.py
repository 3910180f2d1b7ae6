"""Property-based fuzzing of structured-output constraints through the gateway's sandbox (`gateway/constraints.py`).

Hypothesis builds constraints of every kind: JSON schemas (nested objects and arrays, enums, consts,
patterns, numeric bounds up to hundreds of digits, nesting up to 1,000 deep, as objects or as text),
regexes (counted repetition nested up to three deep, alternations, classes), Lark grammars (chains of
rules up to 3,000 long, up to 3,000 alternatives, recursion, regex terminals), GBNF, choices and
llguidance's own form, among them the shapes that once crashed or wedged a role. One sandbox of
real child processes (the demo model's tokenizer) serves the module. Properties, for each:

- the sandbox answers a grammar or an InvalidRequestError naming the constraint's field, within its
  time bound (and the time a crashed child's replacement takes), and never any other exception;
- a grammar it accepts builds an LLMatcher with `parser_limits()` and the demo tokenizer in this
  process, and its first mask is computed without error (what a worker does with it);
- the sandbox stays usable: a fresh constraint compiles after every example, and it never runs more
  children than it was given.

Derandomized when CI is set; for a longer hunt:
LORASERVE_FUZZ_EXAMPLES=1000 .venv/bin/python -m pytest -q tests/fuzz/test_fuzz_constraints.py
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidRequestError
from loraserve.gateway.constraints import ConstraintConfig, ConstraintSandbox, TokenizerSpec
from loraserve.structured import Constraint, ll_tokenizer, parser_limits
from loraserve.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("LORASERVE_FUZZ_EXAMPLES", "500"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
CONFIG = ConstraintConfig(constraint_workers=2, constraint_timeout=2.0)
SLACK_S = 5.0  # waiting for a crashed child's replacement, on a machine shared with other tests
FIELDS = ["guided_json", "guided_regex", "guided_grammar", "response_format", "sampling.structured_output.grammar"]

# ---- JSON schemas -----------------------------------------------------------------------------------
_HUGE = st.integers(1, 400).map(lambda digits: 10**digits)
_INTEGER = st.one_of(
    st.integers(-1000, 1000), st.sampled_from([-(2**63), 2**63 - 1, 2**64 - 1, 2**64]), _HUGE, _HUGE.map(lambda n: -n)
)
_NUMBER = st.one_of(_INTEGER, st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e-308]))
_WORD = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
_LEAF = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "maxLength": st.integers(0, 3000),
            "minLength": st.integers(0, 5),
            "pattern": st.sampled_from(["^[a-z]+$", "[0-9]{3}-[0-9]{4}", "(a|b)*c", "x{2,5}", "(x{100}){100}"]),
            "format": st.sampled_from(["date-time", "email", "uuid", "uri", "date"]),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["integer", "number"])},
        optional={"minimum": _NUMBER, "maximum": _NUMBER, "exclusiveMinimum": _NUMBER, "multipleOf": _NUMBER},
    ),
    st.lists(_WORD, min_size=1, max_size=8).map(lambda words: {"enum": words}),
    st.one_of(_WORD, _INTEGER).map(lambda value: {"const": value}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}, {"type": "nonsense"}, {"$ref": "#/nowhere"}]),
)


def _objects(inner: st.SearchStrategy) -> st.SearchStrategy:
    properties = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, min_size=1, max_size=4)
    return st.one_of(
        st.tuples(properties, st.booleans(), st.booleans()).map(
            lambda t: (
                {"type": "object", "properties": t[0]}
                | ({"required": sorted(t[0])} if t[1] else {})
                | ({"additionalProperties": False} if t[2] else {})
            )
        ),
        st.tuples(inner, st.integers(0, 3), st.integers(0, 300)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[2]}
        ),
        st.lists(inner, min_size=2, max_size=4).map(lambda options: {"anyOf": options}),
    )


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


_SCHEMA = st.one_of(
    st.recursive(_LEAF, _objects, max_leaves=12),
    st.sampled_from([1, 10, 60, 64, 127, 128, 129, 200, 1000]).map(_nested),
)
_JSON_SCHEMA = st.tuples(_SCHEMA, st.booleans()).map(
    lambda t: ("json_schema", json.dumps(t[0]) if t[1] else t[0])  # as text, or as the object HTTP parsed
)
_DEEP_TEXT = st.sampled_from([200, 1000, 5000]).map(lambda n: ("json_schema", "[" * n + "]" * n))

# ---- regexes ----------------------------------------------------------------------------------------
_ATOM = st.sampled_from(["a", "x", "[a-z]", "[0-9]", r"\d", ".", "[^,]", "(ab|cd)", "é", r"\w"])


def _regex_of(inner: st.SearchStrategy) -> st.SearchStrategy:
    count = st.sampled_from([0, 1, 2, 10, 100, 1000])
    return st.one_of(
        st.lists(inner, min_size=2, max_size=4).map("".join),
        st.lists(inner, min_size=2, max_size=4).map(lambda parts: "(" + "|".join(parts) + ")"),
        st.tuples(inner, count, count).map(lambda t: f"({t[0]}){{{min(t[1:])},{max(t[1:])}}}"),
        st.tuples(inner, st.sampled_from(["*", "+", "?"])).map(lambda t: f"({t[0]}){t[1]}"),
    )


_REGEX = st.one_of(
    st.recursive(_ATOM, _regex_of, max_leaves=8),
    st.tuples(st.sampled_from([10, 100, 1000]), st.sampled_from([10, 100, 1000]), st.sampled_from([1, 2, 3])).map(
        lambda t: "(" * t[2] + "x" + "".join(f"{{{t[0] if i == 0 else t[1]}}})" for i in range(t[2]))
    ),  # nested counted repetition: ((x{n}){m}){m}
    st.sampled_from(["[a-", "(", "a{2,1}", "\\", "(?<name>a)", "a" * 5000]),
).map(lambda regex: ("regex", regex))

# ---- Lark, GBNF, choices, llguidance ----------------------------------------------------------------


def _chain(rules: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} | "x{i}"' for i in range(rules)), f'r{rules}: "end"'])


def _alternatives(terminals: int) -> str:
    return "start: " + " | ".join(f'"t{i}"' for i in range(terminals))


RECURSIVE = """start: expr
expr: expr "+" term | term
term: "(" expr ")" | NUMBER
NUMBER: /[0-9]{1,4}/
"""
_LARK = st.one_of(
    st.sampled_from([5, 100, 500, 999, 1000, 1500, 3000]).map(_chain),
    st.sampled_from([2, 500, 1999, 2000, 2001, 3000]).map(_alternatives),
    st.just(RECURSIVE),
    st.sampled_from([10, 100, 300]).map(lambda n: "start: " + "(" * n + '"a"' + ")" * n),
    st.recursive(_ATOM, _regex_of, max_leaves=6).map(lambda regex: f"start: WORD+\nWORD: /{regex}/"),
    st.sampled_from(["start: undefined_rule", "start: /[a-/", "nonsense :::", 'root ::= "yes" | "no" | [0-9]+']),
).map(lambda grammar: ("grammar", grammar))
_CHOICE = st.one_of(
    st.lists(_WORD, min_size=0, max_size=12),
    st.sampled_from([1025, 1024]).map(lambda n: [f"choice {i}" for i in range(n)]),
).map(lambda choices: ("choice", choices))
_OTHER = st.one_of(
    st.just(("json_object", True)),
    st.sampled_from([RECURSIVE, _chain(3000), '{"grammars": []}', "not a grammar {"]).map(lambda g: ("llguidance", g)),
)
CONSTRAINTS = st.one_of(_JSON_SCHEMA, _DEEP_TEXT, _REGEX, _LARK, _CHOICE, _OTHER)


# ---- the sandbox, one for the module ----------------------------------------------------------------
@dataclass
class Fuzzed:
    sandbox: ConstraintSandbox
    loop: asyncio.AbstractEventLoop  # the sandbox's, driven by each example in turn
    tokenizer: Any  # the demo model's LLTokenizer, for matchers built in this process

    def compile(self, constraint: Constraint) -> str:
        return self.loop.run_until_complete(self.sandbox.compile(constraint))


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    tokenizer = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
    spec = TokenizerSpec(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    loop = asyncio.new_event_loop()
    sandbox = ConstraintSandbox(spec, CONFIG)
    loop.run_until_complete(sandbox.start())
    yield Fuzzed(sandbox, loop, ll_tokenizer(spec.tokenizer_json, spec.vocab_size, list(spec.eos_token_ids)))
    loop.run_until_complete(sandbox.close())
    loop.close()


_FRESH = itertools.count()


@FUZZ
@given(constraint=CONSTRAINTS, field=st.sampled_from(FIELDS))
def test_the_sandbox_answers_a_grammar_or_a_refusal_in_time_and_stays_usable(fuzzed, constraint, field):
    from llguidance import LLMatcher

    kind, value = constraint
    started = time.monotonic()
    try:
        grammar = fuzzed.compile(Constraint(kind, value, field))
    except InvalidRequestError as e:
        assert e.field == field and e.status == "INVALID_ARGUMENT", e
        grammar = None
    took = time.monotonic() - started
    event(f"{kind}: {'accepted' if grammar is not None else 'refused'}")
    assert took < CONFIG.constraint_timeout + SLACK_S, (kind, took)
    if grammar is not None:  # what a worker does with it
        matcher = LLMatcher(fuzzed.tokenizer, grammar, log_level=0, limits=parser_limits())
        matcher.compute_bitmask()
        assert not matcher.is_error(), (kind, matcher.get_error())
    fresh = Constraint("regex", f"fresh{next(_FRESH)}[a-z]", "guided_regex")  # not in the cache: a child runs it
    assert fuzzed.compile(fresh)
    assert len(fuzzed.sandbox.pids) <= CONFIG.constraint_workers
