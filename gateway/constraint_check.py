"""What the gateway checks of one structured-output constraint before admitting it, in its sandbox.

`check_constraint` is what a sandbox process (`constraint_child.py`) runs for each constraint, with
the model's own tokenizer (`loraserve.structured.ll_tokenizer`, as the worker builds its own):

1. `grammar_for` (`loraserve/structured.py`): the kind compiled to an llguidance grammar, its size,
   nesting and numbers bounded, llguidance's grammar check.
2. `LLMatcher.validate_grammar` against the tokenizer, within `parser_limits()` (what workers use).
3. A matcher built as a worker builds it, its first token mask, and PROBE_STEPS steps more, each
   consuming the lowest allowed token that is not EOS. Some grammars pass every check above and
   break only once output starts (nested counted repetition exhausts the lexer's fuel, thousands of
   alternatives overflow a parser row): the probe meets them here, not in a worker.

Any failure is an InvalidRequestError naming the field. Native crashes (a stack overflow) and
runaway time or memory cannot be caught here: the process running this is what contains them.
"""

from __future__ import annotations

from typing import Any

from loraserve.errors import InvalidRequestError
from loraserve.structured import check_grammar, grammar_for, parser_limits

PROBE_STEPS = 8  # masks computed after the first, each after one more token


def check_constraint(tokenizer: Any, kind: str, value: Any, field: str) -> str:
    """The constraint's grammar, once it compiled and a matcher for `tokenizer` (an LLTokenizer) ran its
    first PROBE_STEPS + 1 masks within `parser_limits()`; InvalidRequestError naming `field` otherwise."""
    grammar = grammar_for(kind, value, field)
    try:
        check_grammar(grammar, field, tokenizer)
        _probe(tokenizer, grammar, field)
    except InvalidRequestError:
        raise
    except Exception as e:  # llguidance raises for API misuse only; anything else is the constraint's
        raise InvalidRequestError(field, f"could not be checked: {type(e).__name__}: {e}") from None
    return grammar


def _probe(tokenizer: Any, grammar: str, field: str) -> None:
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    eos = sum(1 << t for t in tokenizer.eos_tokens)
    for step in range(PROBE_STEPS + 1):
        mask = matcher.compute_bitmask()  # llguidance's layout: token t is bit t of the little-endian bytes
        if matcher.is_error():
            when = "to start" if step == 0 else f"after {_tokens(step)}"
            raise InvalidRequestError(field, f"fails {when}: {_error(matcher)}: simplify it")
        allowed = int.from_bytes(mask, "little") & ~eos
        if step == PROBE_STEPS or matcher.is_stopped() or not allowed:
            return
        if not matcher.consume_token((allowed & -allowed).bit_length() - 1):
            raise InvalidRequestError(field, f"fails after {_tokens(step + 1)}: {_error(matcher)}: simplify it")


def _error(matcher: Any) -> str:
    """The matcher's error without llguidance's non-verbose marker."""
    error = matcher.get_error().replace("<non-verbose/>", "").strip()
    return error if len(error) <= 1000 else error[:1000] + "..."


def _tokens(count: int) -> str:
    return f"{count} token" + ("" if count == 1 else "s")
