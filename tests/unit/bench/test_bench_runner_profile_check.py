"""The runner-profile suite's out-of-sample check: its workload differs from the calibration grid, and
its targets are computed from the per-step ratios, and the suite's exit code and given-profile handling
(no engine runs here: the check itself is replaced)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loraserve.bench.cli import parse_args
from loraserve.bench.common.calibration import calibration_adapters
from loraserve.bench.common.profile_fit import GRIDS, in_sample_fidelity
from loraserve.bench.suites.runner_profile import suite
from loraserve.bench.suites.runner_profile.check import TOLERANCE, CheckWorkload, noise_floor, ratios, within
from loraserve.bench.suites.runner_profile.suite import targets
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import RunnerProfile, model_shape
from loraserve.worker.step_costs import FEATURES, CostModel


def test_the_check_workload_is_deterministic_and_unlike_the_grid():
    grid = GRIDS["quick"]
    adapters = calibration_adapters(grid)
    arrivals = CheckWorkload().arrivals(adapters)
    assert arrivals == CheckWorkload().arrivals(adapters)
    requests = [r for step in arrivals for r in step]
    prompts = {p for p, _, _ in requests}
    assert len(prompts) > 50 and not prompts <= set(grid.prompt_lens)
    assert max(p + o for p, o, _ in requests) > max(grid.prompt_lens) + grid.new_tokens  # longer contexts
    assert max(len(step) for step in arrivals) > 4 and sum(not step for step in arrivals) > 10  # bursts and gaps
    ranks = [adapters[a] for _, _, a in requests if a is not None]
    assert ranks.count(64) > ranks.count(8) and 0.1 < sum(a is None for *_, a in requests) / len(requests) < 0.3


def test_the_targets_are_computed_from_the_ratios():
    real = np.array([1.0, 2.0, 4.0, 1.0])
    checked = ratios(real, real * np.array([0.9, 1.0, 1.1, 1.0]))
    assert checked["total_ratio"] == pytest.approx(1.0375) and within(checked)
    in_sample = {"total_ratio": 0.97, "median_step_ratio": 1.02, "within_tolerance": True}
    met = {t["name"]: (t["value"], t["met"]) for t in targets(in_sample, checked)}
    spread = [checked["p10_step_ratio"], checked["p90_step_ratio"]]
    assert met["out-of-sample step time ratio p10–p90"] == (spread, True)
    assert met["in-sample total and median step time ratio"] == ([0.97, 1.02], True)
    wide = ratios(real, real * np.array([0.5, 1.0, 1.0, 1.5]))
    assert not within(wide) and targets(in_sample, wide)[0]["met"] is False


def test_the_noise_floor_needs_two_passes():
    """With one repeat the real engine would be compared with itself (all 1.0): no figure instead."""
    assert noise_floor([[1.0, 2.0]]) is None
    assert noise_floor([[1.0, 2.0, 4.0], [1.0, 2.0, 2.0]]) == [1.0, pytest.approx(1.8)]


def test_the_in_sample_figure_is_check_ratios_plus_its_median():
    real = np.array([1.0, 2.0, 4.0, 1.0])
    emulated = real * np.array([0.9, 1.0, 1.1, 1.3])
    figure = in_sample_fidelity(real, emulated)
    assert ratios(real, emulated).items() <= figure.items()
    assert figure["median_step_ratio"] == figure["p50_step_ratio"] and figure["tolerance"] == TOLERANCE
    assert figure["within_tolerance"] is True


def _measured_profile(path, fidelity: dict):
    coef = (0.001,) * len(FEATURES)
    costs = CostModel(coef, (0.0, 0.0), (0.0, 0.0), {})
    RunnerProfile(model_shape(ModelConfig.from_dir(DEMO_MODEL_DIR)), coef, costs, fidelity).write(path)
    return path


IN_SAMPLE = {"total_ratio": 1.01, "median_step_ratio": 0.99, "within_tolerance": True}


def _run(tmp_path, monkeypatch, fidelity: dict, spread: float) -> tuple[int, dict]:
    """The suite on a given profile, the out-of-sample check replaced by per-step ratios 1 ± `spread`."""
    real = np.array([1.0, 1.0, 1.0, 1.0, 1.0])
    checked = ratios(real, real * np.array([1 - spread, 1.0, 1.0, 1.0, 1 + spread]))
    monkeypatch.setattr(suite, "out_of_sample", lambda *a, **k: checked)
    given = _measured_profile(tmp_path / "given.json", fidelity)
    out = tmp_path / "out"
    argv = ["--suite", "runner-profile", "--quick", "--runner-profile", str(given), "--out", str(out)]
    code = suite.main(parse_args(argv))
    results = (out / "results.json").exists() and json.loads((out / "results.json").read_text())
    return code, results


def test_the_exit_code_needs_the_out_of_sample_target_too(tmp_path, monkeypatch):
    code, results = _run(tmp_path, monkeypatch, {"in_sample": IN_SAMPLE}, spread=0.5)
    assert [t["met"] for t in results["targets"]] == [False, True] and code == 1
    code, results = _run(tmp_path, monkeypatch, {"in_sample": IN_SAMPLE}, spread=0.05)
    assert [t["met"] for t in results["targets"]] == [True, True] and code == 0


def test_a_given_profile_s_in_sample_target_is_named_as_its_own(tmp_path, monkeypatch):
    _, results = _run(tmp_path, monkeypatch, {"in_sample": IN_SAMPLE}, spread=0.05)
    in_sample = results["targets"][1]
    assert "in-sample" in in_sample["name"] and "given.json's calibration" in in_sample["name"]
    assert in_sample["value"] == [1.01, 0.99]


def test_a_given_profile_without_fidelity_has_no_in_sample_figure(tmp_path, monkeypatch):
    code, results = _run(tmp_path, monkeypatch, {}, spread=0.05)
    in_sample = results["targets"][1]
    assert in_sample["value"] is None and in_sample["met"] is None and code == 1


def test_a_time_scaled_profile_is_refused(tmp_path, monkeypatch, capsys):
    code, results = _run(tmp_path, monkeypatch, {"in_sample": IN_SAMPLE, "time_scale": 6.0}, spread=0.05)
    assert code == 2 and not results and "time-scaled" in capsys.readouterr().err
