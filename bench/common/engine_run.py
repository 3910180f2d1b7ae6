"""The engine suites' shared run: an offline engine in this process, set up, stepped and timed.

    quiet(args.threads)                                     # torch threads; the engine's logs at WARNING
    engine = demo_engine(EngineConfig(device="cpu", max_batch_size=32))
    runs = alternate(repeats, sides, lambda side: measure(engine, side))  # {side: [run, ...]}
    step_seconds = full_batch_steps(engine, batch)          # after queueing `batch` requests
    wall_s, profiler = profiled_decode(engine, adapters, steps=5, warm_steps=3, new_tokens=26, prompt_len=32)

`alternate` runs every side once per round, so all sides are measured under the same conditions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters

if TYPE_CHECKING:
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine

Side = TypeVar("Side")
Run = TypeVar("Run")
NOISY = ("loraserve.worker", "loraserve.kernels")


def quiet(threads: int | None, *loggers: str) -> None:
    """torch on `threads` CPU threads (None: as it is), and the engine's, the kernels' and `loggers`' logs at
    WARNING (or the root logger's level, if higher)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    level = max(logging.WARNING, logging.getLogger().level)
    for name in (*NOISY, *loggers):
        logging.getLogger(name).setLevel(level)


def bench_cache(adapter_cache: Path | None) -> Path:
    """Where random models and adapters are written once: --adapter-cache, else ~/.cache/loraserve-bench."""
    return adapter_cache or Path.home() / ".cache" / "loraserve-bench"


def demo_engine(config: EngineConfig) -> Engine:
    """An engine on the demo model, with the demo adapters registered."""
    from loraserve.worker.engine import Engine

    engine = Engine(DEMO_MODEL_DIR, config)
    for name, path in demo_adapters().items():
        engine.register_adapter(name, path)
    return engine


def alternate(repeats: int, sides: Iterable[Side], run: Callable[[Side], Run]) -> dict[Side, list[Run]]:
    """`repeats` rounds of `run(side)` for every side in turn; each side's runs in order."""
    runs: dict[Side, list[Run]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, done in runs.items():
            done.append(run(side))
    return runs


def full_batch_steps(engine: Engine, batch: int) -> list[float]:
    """Step `engine` until nothing is left; the seconds of each decode step of all `batch` requests at once."""
    steps: list[float] = []
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - started
        if len(outputs) == batch and not any(o.finished for o in outputs) and engine.last_step.tokens == batch:
            steps.append(seconds)
    return steps


def profiled_decode(
    engine: Engine,
    adapters: list[str],
    steps: int,
    warm_steps: int,
    new_tokens: int,
    prompt_len: int,
    seed: int | None = None,
    kernels: bool = True,
) -> tuple[float, object]:
    """A full batch of `prompt_len`-token prompts (request i on adapters[i mod n], or none) prefilled, `warm_steps`
    decode steps, then `steps` decode steps on the wall clock and `steps` more under torch.profiler (CPU,
    and with `kernels` CUDA on a GPU): (those wall seconds, the profiler). The requests are left unfinished."""
    import torch

    from loraserve.worker.sampling import SamplingParams

    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    for i in range(engine.config.max_batch_size):
        prompt = [3 + (7 * i + j) % 1000 for j in range(prompt_len)]
        engine.add_request(prompt, sampling, adapters[i % len(adapters)] if adapters else None)
    while any(not r.output_ids for r in engine.requests.values()):  # prefill everything
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if kernels and engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    start = time.perf_counter()  # timed apart from the profiler, which slows the host down
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            engine.step()
    return wall, profiler
