"""Structured-output matchers are built off the worker's step loop, and a failing one ends only its request.

A real worker service (emulated engine, `inproc_worker.py`) gets requests with grammars beside a plain
one. A grammar whose first mask takes most of a second (nested counted repetition, which then exceeds
llguidance's limits at its first token) is parked while a build thread pays for it: the plain request's
tokens keep coming at the pace of its 2 ms steps, and the costly request ends alone, INVALID_ARGUMENT
naming structured output, not INTERNAL and not handed back for a retry. A valid grammar's request is
admitted once its matcher is built and its output matches; an invalid grammar ends its request the same
way as the costly one.
"""

from __future__ import annotations

import re
from itertools import pairwise

import pytest
from emulated import fixed_profile
from inproc_worker import InprocWorker
from llguidance import LLMatcher

from loraserve.params import SamplingParams

POISON = LLMatcher.grammar_from_regex("(x{1000}){1000}")  # ~0.7 s for its first mask, then over the limits
WORD = "[a-z]{3,6}"
STEP_S = 0.002
MAX_GAP_S = 0.45  # between the plain request's tokens; the poison's first mask on the step loop took 0.6-1 s


@pytest.fixture
def worker(tmp_path):
    worker = InprocWorker(fixed_profile(tmp_path / "profile.json", step_s=STEP_S))
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.close()


def test_a_costly_grammar_is_built_off_the_step_loop_and_ends_only_its_request(worker):
    worker.assign("plain", [1, 40, 41, 42], SamplingParams(max_new_tokens=400, ignore_eos=True))
    worker.pump_until(lambda: len(worker.streams["plain"].tokens) >= 5, 30, "the plain request never started")
    worker.assign("poison", [1, 40, 41], SamplingParams(max_new_tokens=16, grammar=POISON))
    worker.assign("word", [1, 40, 41], SamplingParams(max_new_tokens=16, grammar=LLMatcher.grammar_from_regex(WORD)))
    worker.assign("invalid", [1, 40, 41], SamplingParams(max_new_tokens=8, grammar="start: ( unclosed"))
    worker.wait_ended("poison", "word", "invalid", "plain")

    plain, poison, word, invalid = (worker.streams[r] for r in ("plain", "poison", "word", "invalid"))
    assert plain.end.error_status is None and len(plain.tokens) == 400
    gaps = [b - a for a, b in pairwise(plain.times)]
    assert max(gaps) < MAX_GAP_S, f"the plain request waited {max(gaps):.2f} s between tokens: a grammar held a step"

    assert poison.end.error_status == "INVALID_ARGUMENT", poison.end
    assert poison.end.error.startswith("structured_output:") and "simplify" in poison.end.error, poison.end.error
    assert not poison.end.retry, "a request's own constraint is not handed back to fail over"

    assert word.end.error_status is None and word.end.finish_reason == "stop", word.end
    text = worker.service.engine.tokenizer.decode(word.tokens)
    assert re.fullmatch(WORD, text), text

    assert invalid.end.error_status == "INVALID_ARGUMENT" and not invalid.end.retry, invalid.end
    assert invalid.end.error.startswith("structured_output: is not a valid constraint"), invalid.end.error
    finished = {rid for _, report in worker.reports() for rid in report.finished}
    assert {"plain", "poison", "word", "invalid"} <= finished, "every ended request was reported to the scheduler"
