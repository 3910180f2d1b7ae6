"""Structured output in the engine: every output matches its constraint, and each guided token is the
one the sampler would choose among the tokens the constraint allows.

The reference for the second is independent of llguidance: for a `choice` constraint the allowed
tokens are worked out from strings (a token is allowed when the text so far plus its text is a prefix
of a choice; EOS when the text is a choice), and the logits are transformers + peft's. Greedy guided
decoding must pick the allowed token with the highest reference logit (within 1e-4: the engine's
logits agree with PEFT's to that tolerance, see test_engine_parity.py).
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from helpers import hf_sequence_logits

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.errors import InvalidRequestError
from loraserve.structured import grammar_for
from loraserve.tokenizer import Tokenizer
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.grammar import unpack
from loraserve.worker.request import FinishReason
from loraserve.worker.sampling import SamplingParams, TokenMask, sample

TOL = 1e-4
PROMPT = "the quiet king"
ADAPTERS = (None, "upper", "reverse", "rot13")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["calm", "stormy"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}( [a-z]{2,6}){2}\."
CHOICES = ["the king", "the queen", "a river"]
LARK = 'start: "answer: " NUMBER\nNUMBER: /[1-9][0-9]{0,3}/'


def _valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"answer: [1-9][0-9]{0,3}", text) is not None


CONSTRAINTS = {
    "json_schema": SCHEMA,
    "json_object": True,
    "regex": REGEX,
    "choice": CHOICES,
    "grammar": LARK,
}


@pytest.fixture(scope="module")
def engine():
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=256))
    for name in ADAPTERS[1:]:
        engine.register_adapter(name, demo_adapters()[name])
    yield engine
    engine.close()


def _guided(kind: str, adapter: str | None, **sampling) -> GenerateRequest:
    grammar = grammar_for(kind, CONSTRAINTS[kind], kind)
    return GenerateRequest(prompt=PROMPT, adapter=adapter, sampling=SamplingParams(grammar=grammar, **sampling))


def test_every_output_matches_its_constraint_across_adapters_and_seeds(engine):
    """All bounded kinds, four adapters, greedy and three seeds, in one batch beside unconstrained requests
    (any JSON object is unbounded: the demo model may write one string to the end, see the next test)."""
    guided = [
        (kind, _guided(kind, adapter, max_new_tokens=120, **sampling))
        for kind in CONSTRAINTS
        if kind != "json_object"
        for adapter in ADAPTERS
        for sampling in ({}, *({"temperature": 1.0, "seed": s} for s in range(3)))
    ]
    free = [GenerateRequest(prompt=PROMPT, adapter=a, sampling=SamplingParams(max_new_tokens=24)) for a in ADAPTERS]
    results = engine.generate([g for _, g in guided] + free)
    for (kind, request), result in zip(guided, results, strict=False):
        assert result.finish_reason is FinishReason.STOP, (kind, request.adapter, result.text)
        assert _valid(kind, result.text), (kind, request.adapter, result.text)
    texts = {kind: {r.text for (k, _), r in zip(guided, results, strict=False) if k == kind} for kind, _ in guided}
    assert all(len(t) > 1 for t in texts.values()), texts  # the constraint guides; it does not dictate


def test_any_json_object_is_an_object_where_it_ends(engine):
    """A whole answer is a JSON object; one cut by max_new_tokens is one's beginning (a string left open)."""
    requests = [
        _guided("json_object", a, max_new_tokens=200, temperature=1.0, seed=s) for a in ADAPTERS for s in range(4)
    ]
    results = engine.generate(requests)
    ended = [r for r in results if r.finish_reason is FinishReason.STOP]
    assert ended and all(_valid("json_object", r.text) for r in ended)
    for r in results:
        assert r.text.startswith("{") and (r.finish_reason is FinishReason.STOP or len(r.token_ids) == 200)


def test_unconstrained_requests_are_untouched_by_guided_neighbours(engine):
    free = [GenerateRequest(prompt=PROMPT, adapter=a, sampling=SamplingParams(max_new_tokens=16)) for a in ADAPTERS]
    alone = [r.token_ids for r in engine.generate(free)]
    mixed = engine.generate([_guided("json_schema", a, max_new_tokens=60) for a in ADAPTERS] + free)
    assert [r.token_ids for r in mixed[len(ADAPTERS) :]] == alone


def _allowed_by_choices(tokenizer: Tokenizer, output: list[int], vocab: int) -> set[int]:
    """The tokens whose text keeps `output`'s text a prefix of a choice (EOS: the text is a choice),
    worked out from strings alone."""
    text = tokenizer.decode(output)
    allowed = set(tokenizer.eos_token_ids) if text in CHOICES else set()
    for token in range(vocab):
        piece = tokenizer.decode([*output, token])[len(text) :]
        if piece and any(c.startswith(text + piece) for c in CHOICES):
            allowed.add(token)
    return allowed


def _llguidance_allowed(matcher, vocab: int) -> list[int]:
    """llguidance's own answer, read from its packed bytes (bit t % 8 of byte t // 8)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab]).tolist()


@pytest.mark.parametrize("adapter", [None, "upper"])
def test_guided_greedy_takes_the_likeliest_allowed_token_by_peft(engine, adapter):
    """The allowed sets are llguidance's (which also rules out tokenizations its tokenizer would never
    produce, such as "t" + "h" where "th" is a token), checked to allow only what the strings allow;
    each guided token must be the one peft's logits rank first among them."""
    from llguidance import LLMatcher, LLTokenizer

    result = engine.generate([_guided("choice", adapter, max_new_tokens=16)])[0]
    assert result.text in CHOICES
    path = None if adapter is None else demo_adapters()[adapter]
    logits = hf_sequence_logits(DEMO_MODEL_DIR, path, result.prompt_ids + result.token_ids)
    vocab = logits.shape[1]
    tokenizer = engine.tokenizer
    ll_tokenizer = LLTokenizer((DEMO_MODEL_DIR / "tokenizer.json").read_text(), eos_token=list(tokenizer.eos_token_ids))
    matcher = LLMatcher(ll_tokenizer, grammar_for("choice", CHOICES, "f"))
    for i, token in enumerate(result.token_ids):
        row = logits[len(result.prompt_ids) + i - 1]
        allowed = _llguidance_allowed(matcher, vocab)
        assert set(allowed) <= _allowed_by_choices(tokenizer, result.token_ids[:i], vocab), i
        assert token in allowed and row[token] >= row[allowed].max() - TOL, (i, token)
        assert matcher.consume_token(token)
    assert result.token_ids[-1] in tokenizer.eos_token_ids or matcher.is_stopped()


def test_a_continued_request_goes_on_where_the_first_attempt_stopped(engine):
    whole = engine.generate([_guided("json_schema", "upper", max_new_tokens=80)])[0]
    cut = len(whole.token_ids) // 2
    sampling = SamplingParams(max_new_tokens=80, grammar=grammar_for("json_schema", SCHEMA, "s"))
    request = engine.add_request(whole.prompt_ids, sampling, "upper", output_ids=whole.token_ids[:cut])
    while not request.finished:
        engine.step()
    assert request.output_ids == whole.token_ids


def test_guided_requests_survive_preemption():
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=14, max_batch_size=8))
    engine.register_adapter("upper", demo_adapters()["upper"])
    requests = [
        _guided("json_schema", a, max_new_tokens=60, temperature=1.0, seed=s) for a in (None, "upper") for s in range(4)
    ]
    results = engine.generate(requests)
    engine.close()
    assert sum(r.num_preemptions for r in results) > 0
    assert all(_valid("json_schema", r.text) for r in results)


def test_bad_constraints_are_refused_naming_their_field(engine):
    for kind, value in (
        ("json_schema", '{"type": "nonsense"}'),
        ("json_schema", "{not json"),
        ("json_schema", [1]),
        ("regex", "[a-"),
        ("choice", []),
        ("choice", ["ok", 3]),
        ("grammar", "start: missing_rule"),
        ("llguidance", '{"grammars": 7}'),
    ):
        with pytest.raises(InvalidRequestError) as e:
            grammar_for(kind, value, "response_format")
        assert e.value.field == "response_format", (kind, value)
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(grammar=grammar_for("json_object", True, "f"), ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="grammar"):
        SamplingParams(grammar="")
    grammar = grammar_for("choice", CHOICES, "f")
    with pytest.raises(InvalidRequestError) as e:  # an earlier attempt's tokens the grammar does not allow
        engine.add_request([1, 5], SamplingParams(grammar=grammar), output_ids=engine.tokenizer.encode("zzz", False))
    assert e.value.field == "output_ids"


def test_a_row_whose_mask_allows_nothing_gets_no_token():
    logits = torch.randn(3, 50)
    nothing = torch.zeros(1, 50, dtype=torch.bool)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    history = [([1], [])] * 3
    free = sample(logits, params, [0, 1, 2], history)
    tokens = sample(logits, params, [0, 1, 2], history, TokenMask([1], nothing))
    assert tokens == [free[0], None, free[2]]
    only = torch.zeros(2, 50, dtype=torch.bool)
    only[0, 7] = only[1, 9] = True
    assert sample(logits, params, [0, 1, 2], history, TokenMask([0, 1], only))[:2] == [7, 9]


def test_unpack_reads_llguidances_bit_layout():
    from llguidance.torch import allocate_token_bitmask

    vocab = 70
    allowed = torch.rand(4, vocab) < 0.3
    packed = allocate_token_bitmask(4, vocab).zero_()
    for row, token in allowed.nonzero().tolist():  # llguidance's layout: bit t % 32 of word t // 32
        packed[row, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    assert torch.equal(unpack(packed, vocab, torch.device("cpu")), allowed)
