"""Structured output: a request's constraint (JSON schema, any JSON object, regex, choice, grammar) as a grammar.

Every kind is compiled to one form, an llguidance grammar (its JSON text), which is what travels
with a request's sampling parameters (`SamplingParams.grammar`) and what the worker turns into a
per-token mask (`worker/grammar.py`). llguidance (https://github.com/guidance-ai/llguidance) does the
compiling and the matching; this module names the kinds, bounds what reaches llguidance (sizes,
nesting, numbers it can read) and turns every failure of compiling into InvalidRequestError naming
the field: a constraint is the caller's input, so nothing it makes go wrong is a server error.

Compiling runs llguidance's native code, which some constraints crash (a chain of a few thousand
rules overflows its stack) or keep busy, so the gateway never compiles one in its own process: its
sandbox processes (`gateway/constraints.py`) call `grammar_for` and then check the grammar against
the model's tokenizer. The offline engine's users call `grammar_for` in their own process.

JSON is written compactly (no whitespace between tokens: `{"a":1,"b":[2,3]}`) unless the schema's
own `x-guidance` options say otherwise: free whitespace lets a model pad an answer endlessly. A
schema's objects are closed (`closed_schemas.py`): an object schema that lists its keys allows no
others unless it sets `additionalProperties`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from loraserve.closed_schemas import close_objects
from loraserve.errors import InvalidRequestError

log = logging.getLogger(__name__)

MAX_GRAMMAR_BYTES = 1 << 17  # the compiled grammar's JSON text (a schema, regex or grammar and its wrapping)
MAX_CONSTRAINT_BYTES = 2 * MAX_GRAMMAR_BYTES  # a constraint as given (JSON text may be pretty-printed)
MAX_CHOICES = 1024
MAX_JSON_DEPTH = 128  # a schema's nesting of objects and arrays (llguidance's JSON reader stops there too)
# the integers a schema may hold: JSON's interoperable range (RFC 8259), within what llguidance reads
# (i64, u64), away from the constants near -2^63 that crash it (`{"const": -9223372036854775708}`)
JSON_INTEGERS = (-(2**53 - 1), 2**53 - 1)
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (llguidance's JsonCompileOptions)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "llguidance")
# llguidance's resource limits, the same wherever a matcher is built (the gateway's constraint check and
# the worker's matchers), so a constraint the gateway accepted never exceeds them later in a worker.
# Measured with the demo tokenizer and a 100k-token BPE (the fuel a constraint needs does not grow with
# the vocabulary): the most lexer fuel a legitimate constraint took was ~200k (a choice of 1,024
# strings sharing 100-byte prefixes: the size bound), while `(x{1000}){1000}` burns whatever it is
# given (1M: 0.85-1.3 s and ~300 MB before its error; 250k: ~0.15 s and ~90 MB). Both sides are
# checked by tests/unit/gateway/test_constraint_check.py.
PARSER_LIMITS = {
    "initial_lexer_fuel": 250_000,  # building the lexer's regex ASTs (llguidance's default: 1M, ~50k/ms)
    "step_lexer_fuel": 200_000,  # one mask's lexer work (default; ~14k/ms)
    "step_max_items": 50_000,  # one mask's Earley items (default; ~20k/ms)
    "max_lexer_states": 250_000,  # distinct lexer states, ~1-2 kB each (default)
    "max_grammar_size": 500_000,  # symbols in the grammar's productions (default)
    "max_items_in_row": 2000,  # a production row's branching (default; a choice of 1,024 takes ~1,025)
}


def ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's tokenizer of a model, from its tokenizer.json text, vocabulary size and EOS ids: what the
    gateway's constraint check and the worker's matchers both build theirs with."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


def parser_limits():
    """PARSER_LIMITS as llguidance's LLParserLimits (errors without parser state or grammar text)."""
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS, verbose_errors=False)


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output constraint as the caller wrote it, not compiled yet."""

    kind: str  # one of KINDS
    value: Any  # a schema (JSON text or a dict), a regex or grammar text, a list of choices, True
    field: str  # the request field it came from, which a refusal names (`guided_json`, ...)


def grammar_for(kind: str, value: Any, field: str) -> str:
    """The llguidance grammar of a constraint, checked; InvalidRequestError naming `field` if it is not one
    (whatever goes wrong while compiling it).

    kind: "json_schema" (a schema: JSON text or a dict), "json_object" (any JSON object; value unused),
    "regex" (Rust regex syntax, matched by the whole output), "choice" (a list of strings: the output is
    one of them), "grammar" (Lark in llguidance's dialect, or GBNF) or "llguidance" (llguidance's own
    form: Lark text, or its JSON grammar).
    """
    try:
        grammar = _compile(kind, value, field)
        check_grammar(grammar, field)
    except InvalidRequestError:
        raise
    except RecursionError:
        raise InvalidRequestError(field, "is nested too deeply to compile: flatten it") from None
    except MemoryError:
        raise InvalidRequestError(field, "needs too much memory to compile: simplify it") from None
    except Exception as e:  # llguidance and its converters raise bare exceptions of many classes
        log.info("constraint %s refused: %s: %s", field, type(e).__name__, e)
        raise InvalidRequestError(field, f"could not be compiled: {_short(e)}") from None
    return grammar


def check_grammar(grammar: str, field: str = "structured_output", tokenizer: Any = None) -> None:
    """InvalidRequestError naming `field` unless `grammar` is a valid llguidance grammar of at most
    MAX_GRAMMAR_BYTES (within PARSER_LIMITS; against `tokenizer`, an LLTokenizer, when given)."""
    from llguidance import LLMatcher

    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(field, f"compiles to a grammar over {MAX_GRAMMAR_BYTES} bytes: simplify it")
    error = LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits())
    if error:
        raise InvalidRequestError(field, f"is not a valid constraint: {_short(error, 1000)}")


def _compile(kind: str, value: Any, field: str) -> str:
    from llguidance import LLMatcher, gbnf_to_lark

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(close_objects(json_schema(value, field)), defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(_text(value, field))
    if kind == "choice":
        choices = value if isinstance(value, list | tuple) else None
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(field, f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
        if sum(len(c.encode()) for c in choices) > MAX_GRAMMAR_BYTES:
            raise InvalidRequestError(field, f"are over {MAX_GRAMMAR_BYTES} bytes together: shorten them")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        try:
            lark = gbnf_to_lark.any_to_lark(_text(value, field))
        except InvalidRequestError:
            raise
        except Exception as e:  # the GBNF converter raises bare exceptions (RecursionError on deep nesting)
            raise InvalidRequestError(field, f"is not a Lark or GBNF grammar: {_short(e)}") from None
        return LLMatcher.grammar_from_lark(lark)
    if kind == "llguidance":
        return _text(value, field)
    raise InvalidRequestError(field, f"unknown structured output kind {kind!r} (one of {', '.join(KINDS)})")


def json_schema(value: Any, field: str) -> dict[str, Any]:
    """A schema (JSON text or a parsed value) as a dict llguidance can read: an object, nested at most
    MAX_JSON_DEPTH deep, its integers within JSON_INTEGERS and its numbers finite; InvalidRequestError
    naming `field` otherwise."""
    if isinstance(value, str):
        if len(value.encode()) > MAX_CONSTRAINT_BYTES:
            raise InvalidRequestError(field, f"is over {MAX_CONSTRAINT_BYTES} bytes: simplify it")
        try:
            value = json.loads(value)
        except RecursionError:
            raise InvalidRequestError(field, f"is nested more than {MAX_JSON_DEPTH} levels deep: flatten it") from None
        except ValueError as e:  # not JSON, or an integer of more digits than Python reads
            raise InvalidRequestError(field, f"is not JSON: {_short(e)}") from None
    if value is True:  # JSON Schema's "any value"
        value = {}
    if not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be a JSON schema (an object), got {type(value).__name__}")
    _check_json(value, field)
    return value


def _check_json(value: Any, field: str) -> None:
    """Walks `value` without recursion: its depth, keys, integers and numbers (what llguidance reads)."""
    low, high = JSON_INTEGERS
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise InvalidRequestError(field, f"is nested more than {MAX_JSON_DEPTH} levels deep: flatten it")
            if isinstance(item, dict):
                if not all(isinstance(k, str) for k in item):
                    raise InvalidRequestError(field, "has an object key that is not a string")
                item = item.values()
            pending.extend((child, depth + 1) for child in item)
        elif isinstance(item, bool) or item is None or isinstance(item, str):
            continue
        elif isinstance(item, int):
            if not low <= item <= high:
                raise InvalidRequestError(
                    field, f"has an integer of {item.bit_length()} bits: integers must lie in [-(2^53 - 1), 2^53 - 1]"
                )
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidRequestError(field, "has a number that is not finite")
        else:
            raise InvalidRequestError(field, f"holds a {type(item).__name__}, which is not JSON")


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(field, "must be a non-empty string")
    if len(value.encode()) > MAX_CONSTRAINT_BYTES:
        raise InvalidRequestError(field, f"is over {MAX_CONSTRAINT_BYTES} bytes: simplify it")
    return value


def _short(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip() or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."
