"""Helpers for tests of the emulated runner: a profile without measuring, and an emulated engine."""

from __future__ import annotations

from pathlib import Path

from loraserve.bench.common.calibration import fixed_costs
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.model_config import ModelConfig
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.runner_profile import RunnerProfile, model_shape

MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)
ADAPTERS = (None, "upper", "rot13")  # the base model and two demo adapters


def fixed_profile(path: Path, step_s: float = 0.002, per_token_s: float = 1e-6) -> Path:
    """A demo-model profile written without measuring: each runner step takes `step_s` plus `per_token_s`
    per token."""
    RunnerProfile(model_shape(MODEL), (step_s, 0.0, per_token_s, 0.0, 0.0, 0.0, 0.0), fixed_costs()).write(path)
    return path


def emulated_engine(profile: Path, **config) -> Engine:
    """An emulated engine on the demo model with `ADAPTERS` registered."""
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(runner="emulated", runner_profile=profile, pool_pages=512, **config))
    for name in ADAPTERS[1:]:
        engine.register_adapter(name, demo_adapters()[name])
    return engine
