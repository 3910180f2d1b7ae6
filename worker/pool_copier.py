"""The copier: the pool's tensor and every write of adapter rows into it, on threads or a copy stream.

`UnifiedPool` decides which pages an adapter gets and when it is copied in (bookkeeping, no tensors);
`PoolCopier` owns the tensor those pages live in and makes the copies:

    copier = PoolCopier(layout, model, dtype, device)
    copier.copy(pages, num_rows, adapter)                       # now, on this thread: a miss
    progress = copier.copy_in_background(pages, num_rows, adapter, demand)   # a prefetch
    progress.wait_all()                                         # or per layer, inside the model

Copies go layer by layer, layer 0 first, each as few slice copies as the adapter's pages have
contiguous runs, marking each layer done on the copy's `LayerProgress`. On CUDA a background copy
is queued on the copier's own stream with an event per layer; on the CPU it runs on a thread, and a
large copy is split by layers over a second thread (one memcpy thread gets about half the
bandwidth). The copier also decides each adapter's precision in the pool (`adapter_precision.py`):
half-precision rows go two to a pool row, through `rows_view`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import torch

from loraserve.kernels.batch import page_rows, row_packing, rows_view
from loraserve.model_config import ModelConfig
from loraserve.worker import adapter_precision
from loraserve.worker.adapters import LoraAdapter
from loraserve.worker.layer_progress import LayerProgress
from loraserve.worker.pool_layout import PoolLayout

SPLIT_COPY_BYTES = 4 << 20  # CPU: copies of at least this many bytes are split over the copy threads
INLINE_COPY_BYTES = 4 << 20  # CPU: a copy requests wait on, if smaller, is made at once (a handoff costs more)

Run = tuple[int, int, int]  # (first physical row, first logical row, rows)


def contiguous_runs(pages: tuple[int, ...], rows_per_page: int, num_rows: int) -> list[Run]:
    """The runs of consecutive pages among an adapter's `pages` (in logical order) holding its `num_rows`."""
    runs: list[Run] = []
    for i, page in enumerate(pages):
        logical = i * rows_per_page
        count = min(rows_per_page, num_rows - logical)
        if count <= 0:
            break
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == page * rows_per_page and last[1] + last[2] == logical:
            runs[-1] = (last[0], last[1], last[2] + count)
        else:
            runs.append((page * rows_per_page, logical, count))
    return runs


class PoolCopier:
    """The pool tensor ([layers, pages * rows per page, row width]: KV and adapters) and the copies
    of adapter rows into it."""

    def __init__(
        self,
        layout: PoolLayout,
        model: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = True,
        copy_threads: int = 2,
        adapter_dtype: str = "pool",  # `adapter_precision.py`
    ) -> None:
        self.layout, self.model, self.device, self.adapter_dtype = layout, model, device, adapter_dtype
        shape = (layout.num_layers, layout.rows_per_layer, layout.row_width)
        # Not `zeroed` (the emulated runner's pool, whose KV nothing reads): uninitialized, so the host
        # commits memory only for the pages written.
        allocate = torch.zeros if zeroed else torch.empty
        self.tensor = allocate(shape, dtype=dtype, device=device)
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._executor = None if self._stream else ThreadPoolExecutor(1, thread_name_prefix="adapter-prefetch")
        helpers = copy_threads - 1 if self._stream is None else 0
        self._helpers = ThreadPoolExecutor(helpers, thread_name_prefix="adapter-copy") if helpers > 0 else None

    def row_dtype(self, adapter: LoraAdapter) -> torch.dtype | None:
        """The dtype of `adapter`'s rows in the pool when not the pool's (`adapter_precision.py`), else None."""
        return adapter_precision.row_dtype(self.adapter_dtype, adapter.dtype, self.tensor.dtype)

    def rows_per_page(self, row_dtype: torch.dtype | None) -> int:
        """Rows of an adapter of `row_dtype` one page holds."""
        return self.layout.rows_per_page * row_packing(self.tensor.dtype, row_dtype)

    def row_index(self, pages: list[int], num_rows: int, row_dtype: torch.dtype | None = None) -> torch.Tensor:
        """int64 [num_rows] on the pool's device: the physical row of each logical row of an adapter (a row of
        `rows_view(tensor, row_dtype)`)."""
        return page_rows(pages, self.rows_per_page(row_dtype))[:num_rows].to(self.device)

    def prepare(self, adapter: LoraAdapter) -> LoraAdapter:
        """`adapter` with its rows packed for this pool, pinned when the pool is on CUDA: the host-side
        work of a load, done ahead of it. Thread-safe (reads only the pool's fixed geometry)."""
        rows = self._rows(adapter)
        return adapter if rows is adapter.packed else adapter.with_rows(rows, self.layout.shard)

    def copy(
        self, pages: tuple[int, ...], num_rows: int, adapter: LoraAdapter, progress: LayerProgress | None = None
    ) -> None:
        """Copy `adapter`'s rows into `pages` now (packing first unless `prepare` did), marking `progress`
        as layers land; takes the adapter itself, as a background copy may outlive its host-cache entry."""
        try:
            rows = self._rows(adapter)  # [L, num_rows, W]
            runs = contiguous_runs(pages, self.rows_per_page(rows.dtype), num_rows)
            layers = range(self.layout.num_layers)
            helper = None
            if self._helpers is not None and rows.nbytes >= SPLIT_COPY_BYTES:  # the upper half on a helper
                half = len(layers) // 2
                helper = self._helpers.submit(self.copy_layers, rows, runs, layers[half:], progress)
                layers = layers[:half]
            try:
                self.copy_layers(rows, runs, layers, progress)
            finally:  # never leave a helper writing after this returns (the pages may be freed then)
                if helper is not None:
                    wait([helper])
            if helper is not None:
                helper.result()
        except BaseException as e:
            if progress is not None:
                progress.failed(e)
            raise

    def copy_in_background(
        self, pages: tuple[int, ...], num_rows: int, adapter: LoraAdapter, demand: bool
    ) -> LayerProgress:
        """Start copying `adapter` into `pages`; its progress, layer by layer. `demand`: requests already
        wait on it (on the CPU a small one is then copied at once: a handoff would cost more)."""
        progress = LayerProgress(self.layout.num_layers, self.device)
        if self._stream is not None:  # queued on the copy stream now, an event per layer
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self.copy(pages, num_rows, adapter, progress)
        elif demand and adapter.nbytes < INLINE_COPY_BYTES:
            self.copy(pages, num_rows, adapter, progress)
        else:
            self._executor.submit(self.copy, pages, num_rows, adapter, progress)
        return progress

    def copy_layers(self, rows: torch.Tensor, runs: list[Run], layers: range, progress: LayerProgress | None) -> None:
        """Copy `layers` of `rows` as the slice copies `runs` name, marking each layer done."""
        pool = rows_view(self.tensor, rows.dtype)
        for layer in layers:
            target, source = pool[layer], rows[layer]
            for physical, logical, count in runs:
                target[physical : physical + count].copy_(source[logical : logical + count], non_blocking=True)
            if progress is not None:
                progress.layer_done(layer)

    def close(self) -> None:
        for pool in (self._executor, self._helpers):
            if pool is not None:
                pool.shutdown(wait=True)

    def _rows(self, adapter: LoraAdapter) -> torch.Tensor:
        # rows the store sent: as they are, when they have the dtype they take in the pool
        rows = adapter.rows(self.layout, self.model, self.row_dtype(adapter) or self.tensor.dtype)
        if self.device.type == "cuda" and not rows.is_pinned():
            rows = rows.pin_memory()
        return rows
