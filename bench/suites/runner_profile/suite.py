"""`loraserve bench --suite runner-profile`: calibrate the emulated runner on the real engine.

    loraserve bench --suite runner-profile --quick --out /tmp/profile       # about a minute on 2 cores
    loraserve up --runner emulated --runner-profile /tmp/profile/runner_profile.json --workers 16
    loraserve bench --suite runner-profile --roofline h100-7b --out /tmp/gpu  # computed: a 7B model on an H100

Times the `--model`'s engine over the calibration grid (`bench/common/calibration.py`) and fits the
runner's part and the whole step (`bench/common/profile_fit.py`), then checks the fit in sample and
out of sample (`check.py`). Writes `--out/runner_profile.json` (`worker/runner_profile.py`) and
`--out/results.json` (both checks as records, and the targets: each within ±20 %).
`--runner-profile FILE` checks an existing measured profile out of sample instead of calibrating (a
time-scaled one is refused). The exit code is 0 only when every target is met. With `--roofline
PRESET` nothing is measured: the profile is computed from a GPU's spec-sheet peaks for a model's
shapes (`roofline.py`), and results.json records its example steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.calibration import calibration_adapters
from loraserve.bench.common.engine_run import quiet
from loraserve.bench.common.profile_fit import GRIDS, PROFILE_FILE, TOLERANCE, in_sample_met, write_profile
from loraserve.bench.common.results import publish, target
from loraserve.bench.suites.runner_profile.check import out_of_sample, within
from loraserve.bench.suites.runner_profile.roofline import PRESETS, write_roofline_profile
from loraserve.config_cli import setting
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import load_profile


@dataclass(frozen=True)
class RunnerProfileSettings:
    """The suite's own flag (it also reads --model, --out, --quick and --seed)."""

    roofline: str | None = setting(
        None,
        "compute the profile from a GPU's roofline for a model's shapes instead of measuring this machine "
        f"({', '.join(PRESETS)}: Llama-2-7B shapes, fp16, an H100 SXM's spec-sheet peaks)",
        choices=tuple(PRESETS),
    )


SETTINGS = RunnerProfileSettings


def main(args: argparse.Namespace) -> int:
    """The suite (--model, --out, --quick and --seed are the bench's own flags; --runner-profile FILE, the
    scheduling suite's, checks that measured profile out of sample instead of calibrating one)."""
    if args.out is None:
        raise SystemExit("--suite runner-profile needs --out DIR (it writes DIR/runner_profile.json)")
    if getattr(args, "roofline", None):
        return _roofline(args.roofline, args.out)
    quiet(None)
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
    fit = profile.costs.measured_on.get("fit_median_rel_error")
    print(f"runner profile of {args.model} on {profile.costs.measured_on.get('cpu_model')}: fit median error {fit}")
    print(f"profile: {path}")
    publish(args.out, "runner-profile", records, threads=1, targets=met, **source)
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
    fit = [in_sample["total_ratio"], in_sample["median_step_ratio"]] if has_in else None
    spread = [checked["p10_step_ratio"], checked["p90_step_ratio"]]
    if source is not None:
        name = f"{name} (from {source}'s calibration)"
    return [
        target("out-of-sample step time ratio p10–p90", goal, spread, within(checked)),
        target(name, goal, fit, in_sample_met(in_sample) if has_in else None),
    ]


def _roofline(preset: str, out: Path) -> int:
    path = out / PROFILE_FILE
    profile = write_roofline_profile(preset, path)
    about = profile.roofline.about
    print(f"roofline profile {about['name']}: {about['model']} on {about['device']} (computed, not measured)")
    for name, t in about["examples"].items():
        print(f"  {name}: {t['ms']} ms (memory {t['memory_ms']} ms, compute {t['compute_ms']} ms)")
    records = [{"step": name, **t} for name, t in about["examples"].items()]
    print(f"profile: {path}")
    publish(out, "runner-profile", records, roofline=preset, profile=str(path), kind=about["kind"])
    return 0
