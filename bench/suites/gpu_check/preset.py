"""The sizes the GPU suite runs at: `GPU` (7B shapes on one CUDA device) and `DRY_RUN` (tiny, on CPU).

`loraserve bench --suite gpu-check` takes one of them; `--dry-run` exercises every code path of
the suite on CPU in seconds, so the driver cannot rot between the rare runs on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.bench.common.preset import Preset
from loraserve.bench.common.random_model import LLAMA_7B, LlamaShape


@dataclass(frozen=True)
class GpuPreset(Preset):
    name: str
    device: str
    dtype: str  # float16 | bfloat16 | float32
    backend: str  # the engine's kernel backend
    shape: LlamaShape
    # Engine throughput (offline: every request of an S-LoRA trace arrives at once).
    requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    max_batch_size: int
    adapter_counts: tuple[int, ...]  # loraserve at each n
    baseline_adapters: int  # the n at which PEFT and merge-and-swap run (loraserve too, same trace)
    ranks: tuple[int, ...]
    distinct_weights: int  # adapters share this many weight sets per rank (speed does not depend on values)
    engine_cap_s: float  # a run is cut after this long (its finished requests still count)
    baseline_cap_s: float
    # The stack against the in-process engine (real time, below saturation).
    stack_adapters: int
    stack_rate: float
    stack_duration_s: float
    stack_output_len: tuple[int, int]
    fetch_iterations: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


GPU = GpuPreset(
    name="gpu",
    device="cuda",
    dtype="float16",
    backend="triton",
    shape=LLAMA_7B,
    requests=128,
    input_len=(8, 256),
    output_len=(8, 128),
    max_batch_size=64,
    adapter_counts=(1, 100, 1000),
    baseline_adapters=10,
    ranks=(64, 32, 16, 8),
    distinct_weights=2,
    engine_cap_s=30.0,
    baseline_cap_s=20.0,
    stack_adapters=4,
    stack_rate=8.0,
    stack_duration_s=8.0,
    stack_output_len=(32, 96),
    fetch_iterations=20,
)

DRY_RUN = GpuPreset(
    name="dry-run",
    device="cpu",
    dtype="float32",
    backend="torch",
    shape=LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=88, vocab=1100),
    requests=12,
    input_len=(4, 12),
    output_len=(2, 6),
    max_batch_size=8,
    adapter_counts=(1, 20),
    baseline_adapters=3,
    ranks=(8, 4),
    distinct_weights=2,
    engine_cap_s=60.0,
    baseline_cap_s=60.0,
    stack_adapters=2,
    stack_rate=4.0,
    stack_duration_s=1.0,
    stack_output_len=(2, 4),
    fetch_iterations=3,
)
