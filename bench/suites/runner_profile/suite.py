"""`loraserve bench --suite runner-profile`: calibrate the emulated runner on the real engine.

    loraserve bench --suite runner-profile --quick --out /tmp/profile       # about a minute on 2 cores
    loraserve up --runner emulated --runner-profile /tmp/profile/runner_profile.json --workers 16

Times the real engine (the `--model`'s, on the CPU, torch on one thread) over the scheduling
benchmark's calibration grid (`bench/suites/runner_profile/costs.py`: batch sizes × prompt lengths × adapter
mixes, then heavy-tail requests arriving two per step; each step's least thread CPU time over the
repeats), and fits two linear models of the step's features (`worker/step_costs.py`): the runner's
part (`runner_coef`: the forward pass and sampling, what the emulated runner waits instead) and the
whole step (`costs`, with adapter copy and fetch costs per rank). Then the fidelity check: the same
workload through an engine with the emulated runner, each step's wall time (least over the repeats)
against the real step's — the total and the per-step ratios, recorded in the profile beside the
model's shape and the machine. Writes
`--out/runner_profile.json` (`worker/runner_profile.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from loraserve.bench.common.stats import quantile
from loraserve.bench.suites.runner_profile.costs import (
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
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import RunnerProfile, model_shape

log = logging.getLogger(__name__)

PROFILE_FILE = "runner_profile.json"
GRIDS = {
    "quick": dataclasses.replace(QUICK_GRID, repeats=2),
    "full": dataclasses.replace(QUICK_GRID, batch_sizes=(1, 2, 4, 8, 16, 32, 64), repeats=3),
}
FIDELITY_TOLERANCE = 0.20  # the emulated total step time within 20 % of the real engine's


def main(args: argparse.Namespace) -> int:
    """The suite (--model, --out, --quick and --seed are the bench's own flags)."""
    if args.out is None:
        raise SystemExit("--suite runner-profile needs --out DIR (it writes DIR/runner_profile.json)")
    logging.getLogger("loraserve.worker").setLevel(max(logging.WARNING, logging.getLogger().level))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / PROFILE_FILE
    profile = write_profile(args.model, GRIDS["quick" if args.quick else "full"], path, args.seed)
    f = profile.fidelity
    print(
        f"runner profile of {args.model} on {profile.costs.measured_on.get('cpu_model')}: "
        f"{f['steps']} steps; fit median error {profile.costs.measured_on['fit_median_rel_error']:.1%}; "
        f"emulated / real step time: total {f['total_ratio']:.3f}, median step {f['median_step_ratio']:.3f} "
        f"({'within' if f['within_tolerance'] else 'OUTSIDE'} ±{FIDELITY_TOLERANCE:.0%})"
    )
    print(f"profile: {path}")
    return 0 if f["within_tolerance"] else 1


def write_profile(model_dir: Path, grid: Grid, path: Path, seed: int = 0) -> RunnerProfile:
    """Calibrate on the real engine, write the profile to `path`, check the emulated runner's fidelity
    with it on the same workload, and write the profile again with that figure."""
    started = time.perf_counter()
    calibration = calibrate(model_dir, grid, seed)
    profile = profile_from(calibration, ModelConfig.from_dir(model_dir))
    profile.write(path)
    checked = fidelity(model_dir, path, calibration, grid, seed)
    profile = dataclasses.replace(profile, fidelity={**checked, "wall_s": round(time.perf_counter() - started, 1)})
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
    with one_torch_thread():
        engine = calibration_engine(model_dir, bank, adapters, config)
        try:
            runs = [time_steps(engine, adapters, grid, timer=time.perf_counter) for _ in range(grid.repeats)]
        finally:
            engine.close()
    if any(r.shapes != calibration.shapes for r in runs):
        raise RuntimeError("the emulated engine scheduled the calibration workload differently from the real one")
    emulated = np.array([min(times) for times in zip(*(r.step_s for r in runs), strict=True)])
    real = np.array(calibration.step_s)
    ratios = emulated / real
    total = float(emulated.sum() / real.sum())
    median = float(np.median(ratios))
    return {
        "workload": "the calibration grid",
        "clocks": "real: thread CPU time of engine.step(); emulated: its wall time (least over the repeats)",
        "steps": len(real),
        "real_total_s": round(float(real.sum()), 4),
        "emulated_total_s": round(float(emulated.sum()), 4),
        "total_ratio": round(total, 4),
        "median_step_ratio": round(median, 4),
        "p10_step_ratio": quantile(ratios, 0.1, 4),
        "p90_step_ratio": quantile(ratios, 0.9, 4),
        "tolerance": FIDELITY_TOLERANCE,
        "within_tolerance": abs(total - 1) <= FIDELITY_TOLERANCE and abs(median - 1) <= FIDELITY_TOLERANCE,
    }
