"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.errors import InvalidConfigError
from loraserve.wire import MAX_BATCH

CUDA_GRAPHS = ("auto", "off", "uncaptured")
RUNNERS = ("real", "emulated")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # "auto" (CUDA if present, else CPU), "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto": float32 on CPU; on CUDA the checkpoint's half type, else bfloat16
    backend: str = "auto"  # kernels: "auto" (triton on CUDA, torch on CPU), "torch", "triton", "torch-bmm"
    max_batch_size: int = 64  # running requests per step
    max_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output tokens; default: the model's max positions
    max_lora_rank: int = 128
    rows_per_page: int = 32  # a KV page then holds 16 tokens
    pool_pages: int | None = None  # size the pool exactly...
    pool_memory_gb: float | None = None  # ...or by memory
    gpu_memory_utilization: float = 0.90  # on CUDA with neither given: this share of the device
    cpu_pool_memory_gb: float = 0.5  # on CPU with neither given
    adapter_pool_fraction: float | None = None  # None: unified pool; else adapters get this share, KV the rest
    prefetch: bool = True  # copy predicted adapters into the pool in the background
    prefix_cache: bool = True  # keep full KV pages for reuse by later requests with the same prefix
    prefetch_depth: int = 16  # waiting requests looked at when predicting adapters
    prefetch_reserve: float = 0.10  # share of pages prefetch leaves free for KV growth
    seed: int = 0  # seeds requests that carry no seed of their own, in arrival order
    adapter_cache_bytes: int | None = None  # host RAM for adapter weights (LRU); None: keep every adapter
    # Pad decode-only steps to a batch-size bucket (`decode_buckets`), the fixed shapes a CUDA graph
    # is captured at; the pads are sequences of one token on a KV page kept aside for them.
    pad_decode_steps: bool = False
    # Decode steps from CUDA graphs, one per bucket (`worker.decode_graphs`): "auto" captures them on
    # CUDA with the triton backend; "off" runs every step eagerly (`--enforce-eager`); "uncaptured"
    # runs the captured path's code each step without capturing it, on any device with the triton
    # backend (how a machine without a GPU checks that path). Graphs pad decode steps.
    cuda_graphs: str = "auto"
    # Compile every kernel variant, and capture the graphs, before serving: "auto" does on CUDA.
    warm_up: str = "auto"  # "auto", "on", "off"
    # "real" runs the model; "emulated" (a benchmark and test tool, `worker/emulated_runner.py`) loads
    # no weights and waits each step's time as `runner_profile` predicts, on the CPU, with
    # deterministic tokens; kernels, graphs and warm-up do not apply to it.
    runner: str = "real"
    runner_profile: Path | None = None  # `bench --suite runner-profile`'s runner_profile.json

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise InvalidConfigError(f"engine config {name}={getattr(self, name)!r}: {why}")

        if self.dtype != "auto" and self.dtype not in DTYPES:
            bad("dtype", f"choose auto, {', '.join(DTYPES)}")
        if self.backend not in ("auto", "torch", "triton", "torch-bmm"):
            bad("backend", "choose auto, torch, triton or torch-bmm")
        if self.cuda_graphs not in CUDA_GRAPHS:
            bad("cuda_graphs", f"choose {', '.join(CUDA_GRAPHS)}")
        if self.warm_up not in ("auto", "on", "off"):
            bad("warm_up", "choose auto, on or off")
        if self.adapter_pool_fraction is not None and not 0.0 < self.adapter_pool_fraction < 1.0:
            bad("adapter_pool_fraction", "must be in (0, 1), or unset for the unified pool")
        for name in ("max_batch_size", "max_batched_tokens", "max_lora_rank", "prefetch_depth"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.max_batch_size > MAX_BATCH:
            bad("max_batch_size", f"must be at most {MAX_BATCH} (what the scheduler accepts in a report)")
        if self.rows_per_page < 2 or self.rows_per_page % 2:
            bad("rows_per_page", "must be an even number >= 2")
        if self.pool_pages is not None and self.pool_pages < 1:
            bad("pool_pages", "must be >= 1")
        if self.pool_memory_gb is not None and self.pool_memory_gb <= 0:
            bad("pool_memory_gb", "must be > 0")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            bad("gpu_memory_utilization", "must be in [0.05, 0.99]")
        if not 0.0 <= self.prefetch_reserve < 1.0:
            bad("prefetch_reserve", "must be in [0, 1)")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        if self.adapter_cache_bytes is not None and self.adapter_cache_bytes < 0:
            bad("adapter_cache_bytes", "must be >= 0, or unset to keep every adapter")
        if self.runner not in RUNNERS:
            bad("runner", f"choose {' or '.join(RUNNERS)}")
        if self.runner == "emulated" and self.runner_profile is None:
            bad(
                "runner",
                "the emulated runner needs runner_profile (--runner-profile FILE): write one with `loraserve "
                "bench --suite runner-profile --model MODEL_DIR --out DIR`, then pass DIR/runner_profile.json",
            )
        if self.runner == "emulated" and self.device not in ("auto", "cpu"):
            bad("device", "the emulated runner runs on the CPU: leave device auto or cpu")

    def decode_buckets(self) -> list[int]:
        """The batch sizes decode steps are padded to: 1, 2, 4, 8, then every multiple of 8, up to max_batch_size."""
        sizes = [b for b in (1, 2, 4) if b < self.max_batch_size] + list(range(8, self.max_batch_size, 8))
        return [*sizes, self.max_batch_size]

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidConfigError(f"engine config device={self.device!r}: CUDA is not available on this machine")
        return device

    def torch_dtype(self, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type != "cuda":
            return torch.float32
        return DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16
