"""Helpers for tests of the emulated runner: a profile without measuring, and an emulated engine."""

from __future__ import annotations

from pathlib import Path

from loraserve.bench.common.calibration import fixed_profile  # noqa: F401 (the tests' import of it)
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.model_config import ModelConfig
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine

MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)
ADAPTERS = (None, "upper", "rot13")  # the base model and two demo adapters


def emulated_engine(profile: Path, **config) -> Engine:
    """An emulated engine on the demo model with `ADAPTERS` registered."""
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(runner="emulated", runner_profile=profile, pool_pages=512, **config))
    for name in ADAPTERS[1:]:
        engine.register_adapter(name, demo_adapters()[name])
    return engine
