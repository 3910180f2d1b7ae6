"""Fitting the emulated runner's profile on the real engine, and its in-sample fidelity: what the
runner-profile suite calibrates and the scheduling suite calibrates before it runs its stack.

    profile = write_profile(model_dir, GRIDS["quick"], out / PROFILE_FILE, seed)

The profile's step model is fitted over the calibration grid (`calibration.py`); then the same grid runs
on an engine with the emulated runner and that profile, and each step's time is compared with the real
step's (`ratios`); the figure is written into the profile as `fidelity["in_sample"]`.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import closing
from pathlib import Path

import numpy as np

from loraserve.bench.common.calibration import (
    CALIBRATION_ENGINE,
    QUICK_GRID,
    Calibration,
    Grid,
    calibrate,
    calibration_adapters,
    calibration_engine,
    fit_step_model,
    one_torch_thread,
    time_steps,
)
from loraserve.bench.common.stats import quantile
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import RunnerProfile, model_shape

TOLERANCE = 0.20  # the suite's one tolerance: p10 and p90 (out of sample), total and median (in sample) within ±20 %


def ratios(real: np.ndarray, emulated: np.ndarray) -> dict:
    """Totals and per-step ratio quantiles of `emulated` against `real` step times."""
    r = emulated / real
    return {
        "steps": len(real),
        "real_total_s": round(float(real.sum()), 4),
        "emulated_total_s": round(float(emulated.sum()), 4),
        "total_ratio": round(float(emulated.sum() / real.sum()), 4),
        "p10_step_ratio": quantile(r, 0.1, 4),
        "p50_step_ratio": quantile(r, 0.5, 4),
        "p90_step_ratio": quantile(r, 0.9, 4),
    }


PROFILE_FILE = "runner_profile.json"
GRIDS = {
    "quick": dataclasses.replace(QUICK_GRID, repeats=2),
    "full": dataclasses.replace(QUICK_GRID, batch_sizes=(1, 2, 4, 8, 16, 32, 64), repeats=3),
}


def in_sample_met(in_sample: dict) -> bool:
    """Whether the in-sample total and median step time ratios both lie within ±TOLERANCE of 1."""
    return all(abs(in_sample[k] - 1) <= TOLERANCE for k in ("total_ratio", "median_step_ratio"))


def write_profile(model_dir: Path, grid: Grid, path: Path, seed: int = 0) -> RunnerProfile:
    """Calibrate on the real engine, write the profile to `path`, check the emulated runner's fidelity
    with it on the same workload (in sample), and write the profile again with that figure."""
    started = time.perf_counter()
    calibration = calibrate(model_dir, grid, seed)
    profile = profile_from(calibration, ModelConfig.from_dir(model_dir))
    profile.write(path)
    checked = fidelity(model_dir, path, calibration, grid, seed) | {"wall_s": round(time.perf_counter() - started, 1)}
    profile = dataclasses.replace(profile, fidelity={"in_sample": checked})
    profile.write(path)
    return profile


def profile_from(calibration: Calibration, model: ModelConfig) -> RunnerProfile:
    """The profile of a calibration: the runner's part of each step fitted, and the whole step's costs."""
    coef, quality = fit_step_model(calibration.shapes, calibration.runner_s)
    costs = calibration.costs()
    costs = dataclasses.replace(costs, measured_on={**costs.measured_on, "runner_fit": quality})
    return RunnerProfile(model_shape(model), tuple(coef), costs)


def fidelity(model_dir: Path, profile_path: Path, calibration: Calibration, grid: Grid, seed: int = 0) -> dict:
    """The calibration workload through an emulated engine with the profile at `profile_path`: each step's
    wall time (least over the repeats) against the real engine's step time."""
    from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
    from loraserve.bench.systems.engine import AdapterBank
    from loraserve.worker.config import EngineConfig

    bank = AdapterBank(SyntheticAdapters(model_dir, seed=seed))
    adapters = calibration_adapters(grid)
    config = EngineConfig(**CALIBRATION_ENGINE, runner="emulated", runner_profile=profile_path)
    with one_torch_thread(), closing(calibration_engine(model_dir, bank, adapters, config)) as engine:
        runs = [time_steps(engine, adapters, grid, timer=time.perf_counter) for _ in range(grid.repeats)]
    if any(r.shapes != calibration.shapes for r in runs):
        raise RuntimeError("the emulated engine scheduled the calibration workload differently from the real one")
    emulated = np.array([min(times) for times in zip(*(r.step_s for r in runs), strict=True)])
    real = np.array(calibration.step_s)
    return in_sample_fidelity(real, emulated)


def in_sample_fidelity(real: np.ndarray, emulated: np.ndarray) -> dict:
    """The in-sample figure from each step's real and emulated times: `check.ratios()`, its p50 also as
    the median step ratio, and whether the total and median lie within ±TOLERANCE of 1."""
    checked = {
        "workload": "in sample: the calibration grid the profile was fitted on",
        "clocks": "real: thread CPU time of engine.step(); emulated: its wall time (least over the repeats)",
        **ratios(real, emulated),
    }
    checked["median_step_ratio"] = checked["p50_step_ratio"]
    return {**checked, "tolerance": TOLERANCE, "within_tolerance": in_sample_met(checked)}
