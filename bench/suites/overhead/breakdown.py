"""Where the LoRA time goes on a CPU: the overhead suite's `--overhead-breakdown` records.

- `gather` (`gather_bandwidth`): what copying rows out of a pool costs on one thread, the work a
  LoRA step's gathers do. A float32 source of SOURCE_MB, and GATHER_MB of it copied into a
  preallocated tensor three ways: random rows of `row_bytes` (`index_select`), random whole pages
  of `page_bytes` (`index_select` over pages), and one contiguous slice (`copy_`). GB/s is the
  bytes copied (10^9 per second) over the median of REPEATS timed copies.
- `profile` (`profile_decode`): torch.profiler over `steps` decode steps of a full batch, once with
  no adapter (`side: "base"`) and once with `n_adapters` distinct ones (`side: "lora"`), on the
  same engine: wall ms per step (timed apart from the profiler, which slows the host down), and the
  operators with the most self CPU time (ms and calls per step), plus the total.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.bench.common.engine_run import profiled_decode
from loraserve.bench.common.stats import median_seconds

SOURCE_MB = 256
GATHER_MB = 40
REPEATS = 7
TOP_OPS = 15
PROMPT_LEN = 24


def gather_bandwidth(row_bytes: int, page_bytes: int, seed: int = 0) -> dict:
    """GB/s copying GATHER_MB out of a SOURCE_MB float32 pool: random rows, random pages, one slice."""
    floats = SOURCE_MB * 2**20 // 4
    source = torch.randn(floats)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, unit in (("rows", row_bytes), ("pages", page_bytes)):
        width = unit // 4
        table = source[: floats // width * width].view(-1, width)
        picks = torch.randint(0, table.shape[0], (GATHER_MB * 2**20 // unit,), generator=g)
        dest = torch.empty(picks.numel(), width)
        seconds = median_seconds(lambda t=table, p=picks, d=dest: torch.index_select(t, 0, p, out=d), REPEATS)
        out[f"{name}_gbps"] = round(dest.numel() * 4 / seconds / 1e9, 2)
    dest = torch.empty(GATHER_MB * 2**20 // 4)
    offset = floats // 2
    seconds = median_seconds(lambda: dest.copy_(source[offset : offset + dest.numel()]), REPEATS)
    out["contiguous_gbps"] = round(dest.numel() * 4 / seconds / 1e9, 2)
    return {
        "kind": "gather",
        "threads": torch.get_num_threads(),
        "row_bytes": row_bytes,
        "page_bytes": page_bytes,
        "megabytes": round(GATHER_MB * 2**20 / 1e6, 2),
        "source_mb": SOURCE_MB,
        "repeats": REPEATS,
        **out,
    }


def _ops(prof, steps: int) -> tuple[list[dict], float]:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    rows = [
        {
            "op": e.key[:80],
            "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
            "calls_per_step": round(e.count / steps, 1),
        }
        for e in top
    ]
    return rows, round(total_ms, 3)


def profile_decode(engine, adapters: list[str], side: str, steps: int = 10) -> dict:
    """`steps` decode steps of a full batch (request i on adapters[i mod n], or none), after prefill:
    wall ms per step, then the same number of steps under torch.profiler."""
    batch = engine.config.max_batch_size
    wall, prof = profiled_decode(engine, adapters, steps, 2, 2 * steps + 8, PROMPT_LEN, seed=0, kernels=False)
    while engine.has_unfinished():
        engine.step()
    top, total = _ops(prof, steps)
    return {
        "kind": "profile",
        "side": side,
        "n_adapters": len(adapters),
        "batch": batch,
        "steps": steps,
        "wall_ms_per_step": round(1e3 * wall / steps, 3),
        "profiled_self_ms_per_step": total,
        "top": top,
    }


def pool_row_bytes(path: Path) -> tuple[int, int]:
    """(bytes of one pool row, bytes of one page) for the model at `path`, float32 as the suite runs it."""
    from loraserve.model_config import ModelConfig
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.pool_layout import PoolLayout

    config = ModelConfig.from_dir(path)
    layout = PoolLayout.for_model(config, EngineConfig().rows_per_page, 1)
    return layout.row_width * 4, layout.row_width * 4 * layout.rows_per_page
