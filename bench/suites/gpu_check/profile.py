"""Where a decode step's time goes: wall-clock per step against the GPU's kernel time, by torch.profiler.

A full batch of requests (max_batch_size, prompts of 32 tokens, `n_adapters` distinct adapters, or
none) is prefilled, a few decode steps warm up, then `steps` decode steps run under the profiler:

    wall_ms_per_step     host clock around engine.step(), without the profiler (the step ends with
                         the sampled tokens on the host, so the GPU is done too)
    kernel_ms_per_step   sum of every CUDA kernel's own time over the next `steps` steps, profiled
    launches_per_step    kernels launched
    gpu_busy             kernel_ms / wall_ms: near 1 the step is GPU-bound; far below it is bound by
                         the host (Python, kernel launches), which CUDA graphs remove
    cuda_graphs          whether decode steps replayed CUDA graphs (`EngineConfig.cuda_graphs`)
    top                  the kernels that took the most time
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import torch

from loraserve.bench.common.engine_run import profiled_decode
from loraserve.bench.systems.engine import AdapterBank
from loraserve.bench.workloads.slora import round_robin_ranks
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine

PROMPT_LEN = 32


def profile_decode(
    model_dir: Path, config: EngineConfig, bank: AdapterBank, n_adapters: int, ranks: tuple[int, ...], steps: int = 5
) -> dict:
    with closing(Engine(model_dir, config)) as engine:
        graphs = engine.runner.graphs is not None
        names = list(round_robin_ranks(n_adapters, ranks).items()) if n_adapters else []
        for name, rank in names:
            engine.adapters.add(name, bank.get(name, rank))
        on_gpu = engine.device.type == "cuda"
        wall, prof = profiled_decode(engine, [n for n, _ in names], steps, 3, 2 * steps + 16, PROMPT_LEN)
    kernels = [e for e in prof.key_averages() if on_gpu and e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    return {
        "n_adapters": n_adapters,
        "cuda_graphs": graphs,
        "batch": config.max_batch_size,
        "wall_ms_per_step": round(1e3 * wall / steps, 3),
        "kernel_ms_per_step": round(kernel_us / 1e3 / steps, 3) if on_gpu else None,
        "launches_per_step": round(sum(e.count for e in kernels) / steps, 1) if on_gpu else None,
        "gpu_busy": round(kernel_us / 1e6 / wall, 3) if on_gpu else None,
        "top": [
            {
                "kernel": e.key[:80],
                "calls_per_step": e.count / steps,
                "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 3),
            }
            for e in top
        ],
    }
