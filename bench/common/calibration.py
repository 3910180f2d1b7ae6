"""What a worker's step and an adapter load cost, measured on the real engine: the emulated runner's calibration.

    costs = calibrate(DEMO_MODEL_DIR, QUICK_GRID).costs()   # ~30 s on one CPU core
    costs.step_s(step_features([(1, 100, 8, "a"), (64, 64, 0, None)]))  # chunks: (tokens, context, rank, adapter)
    costs.copy_s(rank)                                  # one adapter into the pool (a miss, or a prefetch)
    costs.fetch_s(rank)                                 # parse, check and pack its bytes (first use on a worker)

The real `Engine` (the worker's, on the given model, torch on one thread) runs batches
over a grid of compositions — batch sizes, prompt lengths, the base model / one adapter / a distinct
adapter per request with mixed ranks — and every `engine.step()` is timed, prefill, chunked prefill,
mixed and decode steps alike, in the CPU time of the stepping thread (torch on one thread, as a
worker on its own core): on a shared machine, time other processes hold the core is not the
engine's cost. Each step's features are those of the chunks its runner computed (tokens whose KV a
prefix-cache hit supplied are not computed), and its runner's part of the time (`ModelRunner.execute`)
is kept beside the whole step's. The grid is run `repeats` times and each step keeps its least time. A linear model is
fitted to them by least squares weighted by 1/√t (relative error alone lets the many small steps
outvote the full batches that set capacity), coefficients kept non-negative:

    step_s = c0 + c_seq·seqs + c_tok·tokens + c_ad·adapters + c_lora·Σ tokens_i·rank_i
             + c_key·Σ_groups G·S + c_score·Σ_groups G·Q·S

where attention's two groups (decoding sequences, prefill chunks) are each padded to their longest
member: G sequences, S the longest context, Q the longest chunk (`kernels/attention_torch.py`). The
model itself (`CostModel`, `StepFeatures`) lives in `worker/step_costs.py`, where the
emulated runner reads it too (`bench/suites/runner_profile/suite.py` fits its profile from the same timings). A
grid with equal lengths cannot tell padding from useful work, so the grid ends with a batch of
heavy-tail requests arriving two per step (`Grid.mixed`): continuous batching's mixed lengths at
full load.

Adapter costs are timed the same way, per rank, fitted as a + b·rank: `UnifiedPool.ensure` (the copy
into the pool) and the fetch thread's work (`load_adapter_bytes`: safetensors parse and checks, then
packing the rows for the pool).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import cpu_fields
from loraserve.bench.common.stats import quantile
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import RunnerProfile, model_shape
from loraserve.worker.step_costs import CostModel, StepFeatures

# CPU time of the calling thread: what a step costs the core it runs on, without the time other
# processes held that core (the machine is shared). Valid because torch runs one thread here.
clock = time.thread_time

RANKS = (8, 16, 32, 64)


@dataclass(frozen=True)
class Grid(Preset):
    """The batch compositions timed: every batch size × prompt length × adapter mix (`profile_fit.GRIDS`:
    the runner-profile suite's quick and full presets)."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prompt_lens: tuple[int, ...] = (16, 96, 320)
    mixes: tuple[str, ...] = ("base", "one", "distinct")
    new_tokens: int = 6
    load_samples: int = 5
    repeats: int = 3  # each step's time is the least over the repeats (the machine is shared)
    mixed: int = 200  # then this many heavy-tail requests at once: realistic mixed steps


QUICK_GRID = Grid()
TINY_GRID = Grid(
    batch_sizes=(1, 4),
    prompt_lens=(16, 64),
    mixes=("base", "distinct"),
    new_tokens=3,
    load_samples=2,
    repeats=1,
    mixed=12,
)


def fixed_costs() -> CostModel:
    """A plausible cost model without measuring (unit tests): ~2 ms a step plus per-token costs."""
    return CostModel((2e-3, 5e-5, 2e-5, 1e-4, 1e-8, 1e-6, 1e-9), (3e-4, 1e-6), (2e-3, 2e-5), {"source": "fixed"})


def fixed_profile(path: Path, step_s: float = 0.002, per_token_s: float = 1e-6) -> Path:
    """A demo-model runner profile written without measuring: each step takes `step_s` plus `per_token_s`
    per token (the emulated worker of tests and of the gateway suite)."""
    shape = model_shape(ModelConfig.from_dir(DEMO_MODEL_DIR))
    RunnerProfile(shape, (step_s, 0.0, per_token_s, 0.0, 0.0, 0.0, 0.0), fixed_costs()).write(path)
    return path


# ---- measuring -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """The real engine's times over a grid: each step's features and its least time over the repeats,
    whole (`engine.step()`) and the runner's part of it (`ModelRunner.execute`: the forward pass and
    sampling, what the emulated runner stands in for); and adapter copies and fetches per rank."""

    shapes: list[StepFeatures]
    step_s: list[float]
    runner_s: list[float]
    copies: list[tuple[int, float]]  # (rank, seconds)
    fetches: list[tuple[int, float]]
    measured_on: dict

    def costs(self) -> CostModel:
        """The whole step's cost model, fitted (`fit_step_model`)."""
        coef, quality = fit_step_model(self.shapes, self.step_s)
        return CostModel(tuple(coef), _line(self.copies), _line(self.fetches), {**self.measured_on, **quality})


def calibrate(model_dir: Path, grid: Grid = QUICK_GRID, seed: int = 0) -> Calibration:
    """Time the real engine over `grid` (torch on one thread, as a worker on its own core)."""
    with one_torch_thread():
        return _measure(model_dir, grid, seed)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread meanwhile: one core per worker; and `clock` sees only this thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def calibration_adapters(grid: Grid) -> dict[str, int]:
    """The adapters the grid's batches use, name -> rank: enough of each rank for a distinct one per request."""
    n_per_rank = max(grid.batch_sizes) // len(RANKS) + 1
    return {f"cost-{rank}-{i}": rank for i in range(n_per_rank) for rank in RANKS}


def calibration_engine(model_dir: Path, bank, adapters: dict[str, int], config=None):
    """An engine as the calibration runs it (`config`: the same with other settings, e.g. the emulated
    runner), with `adapters` registered, warmed up and all resident: the steps timed copy nothing."""
    from loraserve.bench.systems.engine import warmed_engine
    from loraserve.worker.config import EngineConfig

    def resident(engine) -> None:
        for name in adapters:
            engine.pool.ensure(engine.registry.latest(name))

    return warmed_engine(model_dir, config or EngineConfig(**CALIBRATION_ENGINE), bank, adapters, resident)


# No prefix cache: the grid repeats its prompts, and every step should compute the tokens it is timed for.
CALIBRATION_ENGINE = {
    "device": "cpu",
    "max_batch_size": 64,
    "pool_pages": 2048,
    "prefetch": False,
    "prefix_cache": False,
}


def _measure(model_dir: Path, grid: Grid, seed: int) -> Calibration:
    from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
    from loraserve.bench.systems.engine import AdapterBank

    started = time.perf_counter()
    bank = AdapterBank(SyntheticAdapters(model_dir, seed=seed))
    adapters = calibration_adapters(grid)
    with contextlib.closing(calibration_engine(model_dir, bank, adapters)) as engine:
        runs = [time_steps(engine, adapters, grid) for _ in range(grid.repeats)]
        shapes = runs[0].shapes
        if any(r.shapes != shapes for r in runs):
            raise RuntimeError("the engine scheduled the same batches differently on a repeat")
        step_s = [min(times) for times in zip(*(r.step_s for r in runs), strict=True)]
        runner_s = [min(times) for times in zip(*(r.runner_s for r in runs), strict=True)]
        copies = _time_copies(engine, bank, grid.load_samples)
        fetches = _time_fetches(engine, bank, grid.load_samples)
    measured_on = {
        **cpu_fields(),
        "model": str(model_dir),
        "torch_threads": 1,
        "clock": "thread CPU time",
        "step_samples": len(step_s),
        "measure_wall_s": round(time.perf_counter() - started, 1),
    }
    return Calibration(shapes, step_s, runner_s, copies, fetches, measured_on)


@dataclass
class StepTimes:
    """One pass over the grid: each step's features, its time and its runner's part."""

    shapes: list[StepFeatures] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    runner_s: list[float] = field(default_factory=list)


def time_steps(engine, adapters: dict[str, int], grid: Grid, timer: Callable[[], float] = clock) -> StepTimes:
    """Run the grid's batches through `engine`, timing every step with `timer` (and its runner's part)."""
    names = list(adapters)
    times = StepTimes()
    with RunnerTimer(engine, timer) as runner:
        for batch, prompt_len, mix in itertools.product(grid.batch_sizes, grid.prompt_lens, grid.mixes):
            chosen = {"base": [None] * batch, "one": [names[0]] * batch, "distinct": names[:batch]}[mix]
            for i, adapter in enumerate(chosen):
                add_request(engine, i, (prompt_len, grid.new_tokens, adapter))
            step_all(engine, runner, times)
        if grid.mixed:  # two new requests before each step while they last: a full batch and a queue
            for i, request in enumerate(_mixed_batch(adapters, grid.mixed)):
                add_request(engine, i, request)
                if i % 2:
                    step_all(engine, runner, times, steps=1)
            step_all(engine, runner, times)
    return times


class RunnerTimer:
    """Times each call of `engine.runner.execute` while in use, and notes the features of the batch it
    computed (the runner is put back after). The features come from the runner's chunks, as the emulated
    runner reads them: tokens whose KV a prefix cache hit or a shared prefill supplied are not computed."""

    def __init__(self, engine, timer: Callable[[], float]):
        from loraserve.worker.emulated.runner import batch_features

        self.engine, self.timer, self.last, self.features = engine, timer, 0.0, None
        self.execute, self.batch_features = engine.runner.execute, batch_features

    def __enter__(self) -> RunnerTimer:
        self.engine.runner.execute = self._timed
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.runner.execute  # the instance attribute: the class's method shows again

    def _timed(self, batch, *args, **kwargs):
        self.features = self.batch_features(batch)
        start = self.timer()
        try:
            return self.execute(batch, *args, **kwargs)
        finally:
            self.last = self.timer() - start


def add_request(engine, i: int, request: tuple[int, int, str | None]):
    from loraserve.worker.sampling import SamplingParams

    prompt_len, new, adapter = request
    sampling = SamplingParams(max_new_tokens=new, ignore_eos=True, seed=0)
    return engine.add_request([5 + (i + j) % 200 for j in range(prompt_len)], sampling, adapter, f"c-{i}")


def step_all(engine, runner: RunnerTimer, times: StepTimes, steps: int | None = None) -> None:
    """Step until nothing is left (or `steps` times), timing each step that computed something and noting
    its shape."""
    while engine.has_unfinished() and (steps is None or steps > 0):
        runner.features = None
        start = runner.timer()
        engine.step()
        seconds = runner.timer() - start
        if runner.features is not None:
            times.step_s.append(seconds)
            times.runner_s.append(runner.last)
            times.shapes.append(runner.features)
        steps = None if steps is None else steps - 1


def _mixed_batch(adapters: dict[str, int], n: int) -> list[tuple[int, int, str | None]]:
    """`n` requests of the heavy-tail scenario's mix (sizes, Zipf adapters of every rank)."""
    from loraserve.bench.workloads.scheduling import heavy_tail

    by_rank = {rank: [name for name, r in adapters.items() if r == rank] for rank in set(adapters.values())}
    trace = heavy_tail(100.0, n / 50.0, seed=7, n_adapters=4 * min(len(v) for v in by_rank.values()))
    out = []
    for r in trace.requests[:n]:
        rank, i = trace.adapters[r.adapter], int(r.adapter.rsplit("-", 1)[1])
        out.append((r.prompt_len, r.output_len, by_rank[rank][(i // len(RANKS)) % len(by_rank[rank])]))
    return out


def _prepared(engine, adapter):
    """The adapter as the worker's fetch thread hands it over (packed for the pool)."""
    return engine.pool.copier.prepare(adapter)


def _time_copies(engine, bank, samples: int) -> list[tuple[int, float]]:
    """`UnifiedPool.ensure` of adapters that are not resident: the copy into the pool, per rank."""
    out = []
    for rank, i in itertools.product(RANKS, range(samples)):
        key = engine.adapters.add(f"copy-{rank}-{i}", _prepared(engine, bank.get(f"copy-{rank}-{i}", rank)))
        start = clock()
        assert engine.pool.ensure(key)
        out.append((rank, clock() - start))
    return out


def _time_fetches(engine, bank, samples: int) -> list[tuple[int, float]]:
    """What a worker's fetch thread does with an adapter's bytes before registering it: parse and check
    (`load_adapter_bytes`), then pack for the pool; per rank. The store-to-worker transfer is not
    included (a few hundred KB at most for the demo model's adapters, well under a millisecond)."""
    from loraserve.worker.adapters import load_adapter_bytes

    out = []
    for rank, i in itertools.product(RANKS, range(samples)):
        config, weights = bank.adapters.files(f"fetch-{rank}-{i}", rank)
        start = clock()
        _prepared(engine, load_adapter_bytes(config, weights, bank.model, bank.max_rank))
        out.append((rank, clock() - start))
    return out


def _line(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """a + b·rank through the per-rank medians, both non-negative."""
    ranks = sorted({r for r, _ in samples})
    medians = [float(np.median([s for r, s in samples if r == rank])) for rank in ranks]
    if len(ranks) < 2:
        return (medians[0], 0.0)
    b = np.polyfit(ranks, medians, 1)[0]
    b = max(0.0, float(b))
    return (max(0.0, float(np.mean(medians) - b * np.mean(ranks))), b)


def fit_step_model(shapes: list[StepFeatures], seconds: list[float]) -> tuple[list[float], dict]:
    """Least squares weighted by 1/√t, with non-negative coefficients (features that come out
    negative are dropped and the rest refitted). Returns (coefficients, fit quality)."""
    x = np.array([s.vector() for s in shapes], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    w = 1.0 / np.sqrt(np.maximum(y, 1e-6))  # between absolute error (big steps rule) and relative
    active = [i for i in range(x.shape[1]) if i == 0 or x[:, i].any()]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [i for i, c in zip(active, sol, strict=True) if c >= 0]
    predicted = x @ coef
    rel = np.abs(predicted - y) / y
    quality = {
        "fit_median_rel_error": round(float(np.median(rel)), 3),
        "fit_p90_rel_error": quantile(rel, 0.9, 3),
        "step_s_min": round(float(y.min()), 5),
        "step_s_max": round(float(y.max()), 5),
    }
    return [float(c) for c in coef], quality
