"""The emulated runner's out-of-sample check: a profile fitted on the calibration grid, checked on a
workload it never saw.

    validation = out_of_sample(model_dir, profile_path, profile, calibration_adapters(grid), repeats=2)
    within(validation)   # p10 and p90 of the per-step ratio within ±TOLERANCE of 1

The check workload is a mixed trace in continuous batching, unlike the grid in every dimension the
cost model weighs: arrivals drawn per step in three phases (sparse, a burst, moderate; so batches
of 1 up to the engine's 64 sequences, mixing prefill chunks and decodes), prompt lengths drawn
log-normally (median 110 tokens, 8–440; the grid has 16, 96 and 320 and heavy-tail's two uniform
bands), outputs of 8–64 tokens (contexts to ~500; the grid's reach 326), a fifth of the requests on
the base model and the rest on adapters whose ranks lean high (64: 40 %, 32: 30 %, 16: 20 %, 8:
10 %) with Zipf popularity within a rank. Nothing of it is used in the fit.

The real engine runs it `repeats` times (thread CPU time of each step, least over the repeats, as
the calibration times them), then an engine with the emulated runner and the profile (each step's
wall time, least over the repeats); per step the ratio emulated / real, and its p10, p50 and p90.
The profile's own model is checked too (`model_*`: its whole-step prediction against the real
step, without the emulator's sleeping and the engine's real work around it), and the real engine
against itself (`real_repeat_*`: its first pass over its second, per step; None with one repeat):
what this machine's noise alone does to a per-step ratio.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loraserve.bench.common.calibration import (
    CALIBRATION_ENGINE,
    RANKS,
    RunnerTimer,
    StepTimes,
    add_request,
    calibration_engine,
    clock,
    one_torch_thread,
    step_all,
)
from loraserve.bench.common.profile_fit import TOLERANCE, ratios
from loraserve.bench.common.stats import quantile
from loraserve.worker.runner_profile import RunnerProfile


@dataclass(frozen=True)
class CheckWorkload:
    """The out-of-sample workload's generator (see the module docstring)."""

    seed: int = 11
    phases: tuple[tuple[int, float], ...] = ((40, 0.4), (25, 3.0), (120, 1.0))  # (steps, mean arrivals a step)
    prompt_median: float = 110.0
    prompt_sigma: float = 0.9
    prompt_range: tuple[int, int] = (8, 440)
    output_range: tuple[int, int] = (8, 64)
    base_share: float = 0.2
    rank_weights: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4)  # for RANKS (8, 16, 32, 64)

    def arrivals(self, adapters: dict[str, int]) -> list[list[tuple[int, int, str | None]]]:
        """The requests arriving before each step: (prompt tokens, new tokens, adapter or None)."""
        rng = np.random.default_rng([self.seed, 3])
        by_rank = {rank: [a for a, r in adapters.items() if r == rank] for rank in RANKS}
        steps = []
        for n_steps, mean in self.phases:
            for _ in range(n_steps):
                steps.append([self._request(rng, by_rank) for _ in range(int(rng.poisson(mean)))])
        return steps

    def _request(self, rng: np.random.Generator, by_rank: dict[int, list[str]]) -> tuple[int, int, str | None]:
        low, high = self.prompt_range
        prompt = int(np.clip(round(rng.lognormal(np.log(self.prompt_median), self.prompt_sigma)), low, high))
        output = int(rng.integers(self.output_range[0], self.output_range[1] + 1))
        if rng.random() < self.base_share:
            return prompt, output, None
        names = by_rank[int(rng.choice(RANKS, p=np.array(self.rank_weights) / sum(self.rank_weights)))]
        zipf = 1.0 / np.arange(1, len(names) + 1)
        return prompt, output, names[int(rng.choice(len(names), p=zipf / zipf.sum()))]


def time_workload(engine, arrivals: list[list[tuple]], timer=clock) -> StepTimes:
    """Run `arrivals` through `engine` (each step's requests added before it), timing every step."""
    times = StepTimes()
    n = 0
    with RunnerTimer(engine, timer) as runner:
        for requests in arrivals:
            for request in requests:
                add_request(engine, n, request)
                n += 1
            step_all(engine, runner, times, steps=1)
        step_all(engine, runner, times)
    return times


def out_of_sample(
    model_dir: Path, profile_path: Path, profile: RunnerProfile, adapters: dict[str, int], repeats: int
) -> dict:
    """The check workload on the real engine, then on an emulated one with the profile: per-step ratios."""
    from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
    from loraserve.bench.systems.engine import AdapterBank
    from loraserve.worker.config import EngineConfig

    workload = CheckWorkload()
    arrivals = workload.arrivals(adapters)
    bank = AdapterBank(SyntheticAdapters(model_dir, seed=0))
    runs = {}
    emulated_config = EngineConfig(**CALIBRATION_ENGINE, runner="emulated", runner_profile=profile_path)
    for kind, config, timer in (
        ("real", EngineConfig(**CALIBRATION_ENGINE), clock),
        ("emulated", emulated_config, time.perf_counter),
    ):
        with one_torch_thread(), closing(calibration_engine(model_dir, bank, adapters, config)) as engine:
            runs[kind] = [time_workload(engine, arrivals, timer) for _ in range(repeats)]
    shapes = runs["real"][0].shapes
    if any(r.shapes != shapes for r in runs["real"] + runs["emulated"]):
        raise RuntimeError("the engines scheduled the check workload differently")
    real = np.array([min(t) for t in zip(*(r.step_s for r in runs["real"]), strict=True)])
    emulated = np.array([min(t) for t in zip(*(r.step_s for r in runs["emulated"]), strict=True)])
    modelled = np.array([profile.costs.step_s(s) for s in shapes])
    return {
        "workload": "out of sample: a mixed trace in continuous batching (bench/suites/runner_profile/check.py)",
        "generator": {k: v for k, v in vars(workload).items()},
        "requests": sum(len(a) for a in arrivals),
        "clocks": "real: thread CPU time of engine.step(); emulated: its wall time (least over the repeats)",
        "repeats": repeats,
        **ratios(real, emulated),
        "batch_sizes": [int(min(s.seqs for s in shapes)), int(max(s.seqs for s in shapes))],
        "tokens_per_step": [int(min(s.tokens for s in shapes)), int(max(s.tokens for s in shapes))],
        "longest_request_tokens": max(p + o for step in arrivals for p, o, _ in step),
        **{f"model_{k}": v for k, v in ratios(real, modelled).items() if k.endswith("ratio")},
        "real_repeat_p10_p90_step_ratio": noise_floor([r.step_s for r in runs["real"]]),
    }


def noise_floor(passes: list[list[float]]) -> list[float | None] | None:
    """The real engine against itself: p10 and p90 of its first pass's step times over its second's, per
    step (the machine's noise floor); None with fewer than two passes (a pass against itself is all 1)."""
    if len(passes) < 2:
        return None
    repeat = np.array(passes[0]) / np.array(passes[1])
    return [quantile(repeat, 0.1, 4), quantile(repeat, 0.9, 4)]


def within(validation: dict, tolerance: float = TOLERANCE) -> bool:
    """Whether p10 and p90 of the per-step ratio both lie within ±`tolerance` of 1."""
    return validation["p10_step_ratio"] >= 1 - tolerance and validation["p90_step_ratio"] <= 1 + tolerance
