"""Both runners satisfy the one protocol the engine is typed against (`worker/step_runner.py`)."""

from __future__ import annotations

import inspect
from typing import runtime_checkable

from emulated import emulated_engine, fixed_profile

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.worker.config import EngineConfig
from loraserve.worker.emulated.runner import EmulatedRunner
from loraserve.worker.engine import Engine
from loraserve.worker.runner import ModelRunner
from loraserve.worker.step_runner import Runner


def test_the_model_runner_and_the_emulated_runner_are_runners(tmp_path):
    checked = runtime_checkable(Runner)  # members present on a live runner of each kind
    real = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=64, warm_up="off", cuda_graphs="off"))
    emulated = emulated_engine(fixed_profile(tmp_path / "profile.json"))
    assert isinstance(real.runner, ModelRunner) and isinstance(real.runner, checked)
    assert isinstance(emulated.runner, EmulatedRunner) and isinstance(emulated.runner, checked)
    protocol = list(inspect.signature(Runner.execute).parameters)
    for runner in (ModelRunner, EmulatedRunner):
        assert list(inspect.signature(runner.execute).parameters) == protocol
        assert isinstance(runner.waits_per_layer, bool)
