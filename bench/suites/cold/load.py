"""Fetch + load alone, store → a worker's pool, for a 7B-shaped adapter, against the machine's memcpy bandwidth.

The adapter store runs as a real process (`bench/common/stack_run.py` starts it, preloading a rank-16 fp16
adapter on q/k/v/o of a Llama-7B-shaped model: 33.6 MB); this process plays the worker with the workers'
own code: `AdapterFetcher`, then what the worker's fetch thread does, then `UnifiedPool.ensure` (the copy
into pool rows, a float16 pool on the CPU). Each path is timed from the fetch request to the rows in the
pool:

    files        the adapter's files over the data plane, parsed and checked (`load_adapter_bytes`),
                 packed into rows (`PoolCopier.prepare`), copied in: the path of a store without rows
    rows-tcp     the rows the store packed, over the data plane, per-layer digests checked, copied in
    rows-shm     the rows the store packed, in shared memory named by the reply, copied in
    rows-shm-verified   the same, the mapped rows also hashed against the store's layer digests
                        (`--verify-shared-memory`; off by default, see loraserve/shared_memory.py)

memcpy: one numpy copy of a 64 MiB buffer into another, the bandwidth a single-threaded copy reaches here,
measured once before each load (so that both see the same conditions); a path's
`fraction_of_memcpy` = its GB/s ÷ the median memcpy GB/s measured beside it (the target for
rows-shm: ≥ 0.5). The `memcpy` record is the median over all of them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from loraserve.adapter_store.client import AdapterFetcher, FetchedRows
from loraserve.bench.common.llama7b_files import write_adapter, write_model
from loraserve.bench.common.stack_run import ADAPTER_NAME, store_process
from loraserve.shared_memory import user_dir
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.adapter_rows import rows_adapter
from loraserve.worker.adapters import load_adapter_bytes
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.unified_pool import UnifiedPool

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MEMCPY_BYTES = 64 << 20


class Memcpy:
    """A single-threaded numpy copy of 64 MiB between two buffers whose pages are touched already."""

    def __init__(self) -> None:
        self.source = np.ones(MEMCPY_BYTES, dtype=np.uint8)
        self.target = np.zeros_like(self.source)

    def gbps(self) -> float:
        start = time.perf_counter()
        np.copyto(self.target, self.source)
        return MEMCPY_BYTES / (time.perf_counter() - start) / 1e9


def measure_load(iterations: int, paths: tuple[str, ...], rank: int = 16) -> list[dict]:
    """One record per path (see the module docstring), plus one for memcpy."""
    with tempfile.TemporaryDirectory(prefix="loraserve-bench-load-") as tmp:
        workdir = Path(tmp)
        model = write_model(workdir / "model")
        size = write_adapter(workdir / "adapter", model, rank, MODULES)
        with store_process(workdir / "model", workdir / "adapter", workdir) as data_address:
            return _measure_paths(data_address, model, size, iterations, paths, rank)


def _measure_paths(
    data_address: str, model, size: int, iterations: int, paths: tuple[str, ...], rank: int
) -> list[dict]:
    """Every path's record from the store at `data_address`, and memcpy's."""
    fetchers = {"files": AdapterFetcher(data_address, 30.0), "rows-tcp": AdapterFetcher(data_address, 30.0)}
    fetchers["rows-shm"] = AdapterFetcher(data_address, 30.0, shared_memory=user_dir())
    fetchers["rows-shm-verified"] = AdapterFetcher(data_address, 30.0, shared_memory=user_dir(), verify_shared=True)
    try:
        memcpy, copies = Memcpy(), []
        records = []
        for path in paths:
            registry = AdapterRegistry()
            layout = PoolLayout.for_model(model, rows_per_page=32, num_pages=8)
            pool = UnifiedPool(layout, model, registry, torch.float16, torch.device("cpu"))
            load = _PATHS[path](fetchers[path], pool, registry, model, rank)
            load(0)  # connects, and any first-time set-up
            samples, beside = [], []
            for i in range(1, iterations + 1):
                beside.append(memcpy.gbps())
                start = time.perf_counter()
                load(i)
                samples.append(time.perf_counter() - start)
            median, copy = statistics.median(samples), statistics.median(beside)
            copies += beside
            records.append(
                {
                    "path": path,
                    "iterations": iterations,
                    "megabytes": round(size / 1e6, 2),
                    "median_ms": round(median * 1e3, 2),
                    "p90_ms": round(sorted(samples)[int(0.9 * (len(samples) - 1))] * 1e3, 2),
                    "gbps": round(size / median / 1e9, 3),
                    "memcpy_gbps": round(copy, 3),
                    "fraction_of_memcpy": round(size / median / 1e9 / copy, 3),
                }
            )
        copy = statistics.median(copies)
        return [{"path": "memcpy", "gbps": round(copy, 3), "megabytes": MEMCPY_BYTES / 1e6}, *records]
    finally:
        for fetcher in fetchers.values():
            fetcher.close()


def _files(fetcher: AdapterFetcher, pool: UnifiedPool, registry: AdapterRegistry, model, rank) -> Callable[[int], None]:
    def load(i: int) -> None:
        got = fetcher.fetch_adapter(ADAPTER_NAME, 1)
        adapter = load_adapter_bytes(got.config_json, got.weights, model, rank, got.weights_format, got.sha256)
        registry.register("a", pool.copier.prepare(adapter), version=i + 1)
        assert pool.ensure(("a", i + 1))

    return load


def _rows(fetcher: AdapterFetcher, pool: UnifiedPool, registry: AdapterRegistry, model, rank) -> Callable[[int], None]:
    def load(i: int) -> None:
        got = fetcher.fetch_rows(ADAPTER_NAME, 1, model.kv_width, model.num_layers)
        assert isinstance(got, FetchedRows) and got.shared == (fetcher.shared_memory is not None)
        registry.register(f"a{i}", pool.copier.prepare(rows_adapter(got, model, rank)))  # a new name: nothing unmapped
        assert pool.ensure((f"a{i}", 1))

    return load


_PATHS: dict[str, Callable] = {"files": _files, "rows-tcp": _rows, "rows-shm": _rows, "rows-shm-verified": _rows}
PATHS = tuple(_PATHS)
