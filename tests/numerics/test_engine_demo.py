"""The engine on the embedded demo: all adapters in one batch, each still doing its job, exactly as PEFT."""

from __future__ import annotations

import pytest
from helpers import hf_greedy

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.demo.corpus import HELD_OUT_PROMPTS
from loraserve.demo.styles import shows_style
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.sampling import SamplingParams

SAMPLING = SamplingParams(max_new_tokens=24)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=512))
    for name, path in demo_adapters().items():
        engine.register_adapter(name, path)
    return engine


def test_every_adapter_shows_its_style_in_one_batch(engine):
    names = [None, *demo_adapters()]
    requests = [GenerateRequest(prompt=p, adapter=a, sampling=SAMPLING) for p in HELD_OUT_PROMPTS[:4] for a in names]
    results = engine.generate(requests)
    assert engine.stats()["adapters"]["loads"] >= len(names) - 1
    for request, result in zip(requests, results, strict=True):
        assert shows_style(request.adapter or "plain", result.text), (
            request.adapter,
            request.prompt,
            result.text,
        )


def test_demo_batch_is_token_exact_with_peft(engine):
    prompt = HELD_OUT_PROMPTS[1]
    names = [None, *demo_adapters()]
    results = engine.generate([GenerateRequest(prompt=prompt, adapter=a, sampling=SAMPLING) for a in names])
    adapters = demo_adapters()
    for name, result in zip(names, results, strict=True):
        expected = hf_greedy(DEMO_MODEL_DIR, adapters.get(name), result.prompt_ids, SAMPLING.max_new_tokens)
        cut = expected.index(2) + 1 if 2 in expected else len(expected)  # the engine stops at EOS
        assert result.token_ids == expected[:cut], name
