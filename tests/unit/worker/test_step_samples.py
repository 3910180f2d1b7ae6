"""What a worker tells the scheduler's cost model: each step's batch composition, measured.

The engine records every step's shape — tokens computed, Σ adapter rank over them, distinct
adapters, KV pages read — as scheduler/cost_model.py defines them; the worker sends them with the
step's measured seconds in its reports. Checked here against the composition computed by hand from
the requests and the adapters' ranks (read from their adapter_config.json, not from the engine).
"""

from __future__ import annotations

import json

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.gateway.adapter_versions import AdapterVersions
from loraserve.scheduler.cost_model import BatchShape, StepCostModel
from loraserve.v1 import adapter_store_pb2
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.sampling import SamplingParams


def _rank(name: str) -> int:
    return json.loads((demo_adapters()[name] / "adapter_config.json").read_text())["r"]


def test_each_step_records_the_batch_composition_the_cost_model_uses():
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=160, max_batch_size=4))
    try:
        for name in ("upper", "rot13"):
            engine.register_adapter(name, demo_adapters()[name])
        per_page = engine.layout.tokens_per_page
        prompts = {"upper": list(range(5, 25)), "rot13": list(range(5, 45)), None: list(range(5, 12))}
        for adapter, prompt in prompts.items():
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=4), adapter, f"r-{adapter}")
        engine.step()  # one step prefills all three prompts (well under max_batched_tokens)
        lengths = {a: len(p) for a, p in prompts.items()}
        assert engine.last_step.tokens == sum(lengths.values())
        assert engine.last_step.rank_tokens == sum(n * _rank(a) for a, n in lengths.items() if a is not None)
        assert engine.last_step.adapters == 2
        assert engine.last_step.kv_pages == sum(-(-n // per_page) for n in lengths.values())
        engine.step()  # a decode step: one token each, one more position of KV
        assert engine.last_step.tokens == 3
        assert engine.last_step.rank_tokens == _rank("upper") + _rank("rot13")
        assert engine.last_step.kv_pages == sum(-(-(n + 1) // per_page) for n in lengths.values())
    finally:
        engine.close()


def test_the_cost_model_learns_from_step_samples_like_those():
    """Samples in the shape workers send move the model's prediction toward the measured seconds."""
    model = StepCostModel()
    shape = BatchShape(tokens=64, rank_tokens=64 * 16, adapters=2, kv_pages=40)
    before = model.step_s(shape)
    for _ in range(200):
        model.observe(shape, before * 3)
    assert abs(model.step_s(shape) - before * 3) < 0.1 * before


def test_the_gateway_learns_each_adapters_rank_from_the_store_watch():
    versions = AdapterVersions()
    versions.apply(adapter_store_pb2.AdapterChange(name="a", version=2, sha256="ab" * 32, rank=32))
    versions.apply(adapter_store_pb2.AdapterChange(synced=True))
    assert versions.get("a").rank == 32
