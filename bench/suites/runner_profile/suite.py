"""`loraserve bench --suite runner-profile`: calibrate the emulated runner on the real engine.

    loraserve bench --suite runner-profile --quick --out /tmp/profile       # about a minute on 2 cores
    loraserve up --runner emulated --runner-profile /tmp/profile/runner_profile.json --workers 16
    loraserve bench --suite runner-profile --roofline h100-7b --out /tmp/gpu  # computed: a 7B model on an H100

With `--roofline PRESET` nothing is measured: the profile is computed from a GPU's spec-sheet peaks
for a model's shapes (`bench/suites/runner_profile/roofline.py`) and written to the same file.

Times the real engine (the `--model`'s, on the CPU, torch on one thread) over the scheduling
benchmark's calibration grid (`bench/suites/runner_profile/costs.py`: batch sizes × prompt lengths × adapter
mixes, then heavy-tail requests arriving two per step; each step's least thread CPU time over the
repeats), and fits two linear models of the step's features (`worker/step_costs.py`): the runner's
part (`runner_coef`: the forward pass and sampling, what the emulated runner waits instead) and the
whole step (`costs`, with adapter copy and fetch costs per rank). Then the fidelity checks, each
step's wall time on an engine with the emulated runner (least over the repeats) against the real
step's: in sample (the same grid) and out of sample (`check.py`: a mixed trace the fit never saw),
recorded in the profile beside the model's shape and the machine. Writes `--out/runner_profile.json`
(`worker/runner_profile.py`) and `--out/results.json` (both checks as records, and the targets: the
out-of-sample per-step ratio's p10–p90 within ±20 %, the in-sample total and median within ±20 %).
`--runner-profile FILE` checks an existing measured profile out of sample instead of calibrating (its
in-sample figure is FILE's own calibration's, if it has one; a time-scaled profile is refused). The
exit code is 0 only when every target is met (both, out of sample and in sample; an in-sample target
FILE has no figure for is not met), 1 otherwise. With `--roofline`, `--out/results.json` records the
computed example steps (no targets: nothing is measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loraserve.bench.common.results import write_results
from loraserve.bench.common.settings import add_settings
from loraserve.bench.suites.runner_profile.check import TOLERANCE, out_of_sample, ratios, within
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
from loraserve.bench.suites.runner_profile.roofline import PRESETS, write_roofline_profile
from loraserve.config_cli import setting
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import RunnerProfile, load_profile, model_shape

log = logging.getLogger(__name__)

PROFILE_FILE = "runner_profile.json"
GRIDS = {
    "quick": dataclasses.replace(QUICK_GRID, repeats=2),
    "full": dataclasses.replace(QUICK_GRID, batch_sizes=(1, 2, 4, 8, 16, 32, 64), repeats=3),
}


@dataclass(frozen=True)
class RunnerProfileSettings:
    """The suite's own flag (it also reads --model, --out, --quick and --seed)."""

    roofline: str | None = setting(
        None,
        "compute the profile from a GPU's roofline for a model's shapes instead of measuring this machine "
        f"({', '.join(PRESETS)}: Llama-2-7B shapes, fp16, an H100 SXM's spec-sheet peaks)",
        choices=tuple(PRESETS),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's flag (`RunnerProfileSettings`), in a group of its own."""
    add_settings(parser.add_argument_group("runner-profile suite (--suite runner-profile)"), RunnerProfileSettings)


def main(args: argparse.Namespace) -> int:
    """The suite (--model, --out, --quick and --seed are the bench's own flags; --runner-profile FILE, the
    scheduling suite's, checks that measured profile out of sample instead of calibrating one)."""
    if args.out is None:
        raise SystemExit("--suite runner-profile needs --out DIR (it writes DIR/runner_profile.json)")
    if getattr(args, "roofline", None):
        return _roofline(args.roofline, args.out)
    logging.getLogger("loraserve.worker").setLevel(max(logging.WARNING, logging.getLogger().level))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / PROFILE_FILE
    grid = GRIDS["quick" if args.quick else "full"]
    given = getattr(args, "runner_profile", None)
    if given:
        profile = load_profile(given, ModelConfig.from_dir(args.model))
        if profile.roofline is not None:
            raise SystemExit(f"{given} is a roofline profile: computed for a GPU, nothing here to check it against")
        scale = profile.fidelity.get("time_scale", 1.0)
        if scale != 1:
            print(
                f"{given} is time-scaled (fidelity.time_scale {scale!r}): its steps are not this machine's; "
                "check the unscaled profile it was made from",
                file=sys.stderr,
            )
            return 2
        profile.write(path)
    else:
        profile = write_profile(args.model, grid, path, args.seed)
    in_sample = in_sample_of(profile.fidelity)
    checked = out_of_sample(args.model, path, profile, calibration_adapters(grid), repeats=grid.repeats)
    profile = dataclasses.replace(profile, fidelity={"in_sample": in_sample, "out_of_sample": checked})
    profile.write(path)
    met = targets(in_sample, checked, source=given)
    records = [{"sample": "in", **in_sample}, {"sample": "out", **checked}]
    source = {"profile": str(given) if given else "calibrated by this run", "grid": dataclasses.asdict(grid)}
    write_results(args.out, "runner-profile", records, threads=1, targets=met, **source)
    fit = profile.costs.measured_on.get("fit_median_rel_error")
    print(f"runner profile of {args.model} on {profile.costs.measured_on.get('cpu_model')}: fit median error {fit}")
    for t in met:
        print(f"  {t['name']}: {t['value']} ({'met' if t['met'] else 'MISSED'}: {t['goal']})")
    print(f"profile: {path}; results: {args.out / 'results.json'}")
    return 0 if all(t["met"] for t in met) else 1


def in_sample_of(fidelity: dict) -> dict:
    """A profile's in-sample figure: `fidelity["in_sample"]`, or (a version 1 profile's) the fidelity
    itself when it has one's fields, else {} (none recorded)."""
    if "in_sample" in fidelity:
        return dict(fidelity["in_sample"] or {})
    return dict(fidelity) if "total_ratio" in fidelity else {}


def targets(in_sample: dict, checked: dict, source: Path | str | None = None) -> list[dict]:
    """The suite's targets: out-of-sample (the check workload) and in-sample (the fit's own grid; with
    `source`, a given profile file, the figure its calibration recorded: value and met None without one)."""
    goal = f"within ±{TOLERANCE:.0%}".replace("%", " %")
    name = "in-sample total and median step time ratio"
    has_in = "total_ratio" in in_sample and "median_step_ratio" in in_sample
    return [
        {
            "name": "out-of-sample step time ratio p10–p90",
            "goal": goal,
            "value": [checked["p10_step_ratio"], checked["p90_step_ratio"]],
            "met": within(checked),
        },
        {
            "name": name if source is None else f"{name} (from {source}'s calibration)",
            "goal": goal,
            "value": [in_sample["total_ratio"], in_sample["median_step_ratio"]] if has_in else None,
            "met": in_sample_met(in_sample) if has_in else None,
        },
    ]


def in_sample_met(in_sample: dict) -> bool:
    """Whether the in-sample total and median step time ratios both lie within ±TOLERANCE of 1."""
    return all(abs(in_sample[k] - 1) <= TOLERANCE for k in ("total_ratio", "median_step_ratio"))


def _roofline(preset: str, out: Path) -> int:
    path = out / PROFILE_FILE
    profile = write_roofline_profile(preset, path)
    about = profile.roofline.about
    print(f"roofline profile {about['name']}: {about['model']} on {about['device']} (computed, not measured)")
    for name, t in about["examples"].items():
        print(f"  {name}: {t['ms']} ms (memory {t['memory_ms']} ms, compute {t['compute_ms']} ms)")
    records = [{"step": name, **t} for name, t in about["examples"].items()]
    results = write_results(out, "runner-profile", records, roofline=preset, profile=str(path), kind=about["kind"])
    print(f"profile: {path}; results: {results}")
    return 0


def write_profile(model_dir: Path, grid: Grid, path: Path, seed: int = 0) -> RunnerProfile:
    """Calibrate on the real engine, write the profile to `path`, check the emulated runner's fidelity
    with it on the same workload (in sample), and write the profile again with that figure."""
    started = time.perf_counter()
    calibration = calibrate(model_dir, grid, seed)
    profile = profile_from(calibration, ModelConfig.from_dir(model_dir))
    profile.write(path)
    checked = fidelity(model_dir, path, calibration, grid, seed)
    checked = {**checked, "wall_s": round(time.perf_counter() - started, 1)}
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
