"""Adapter copies on a tensor-parallel worker: rank 0's copier queues each for the other ranks, whole.

Rank 0 copies its part of an adapter into its pool as any worker does (`worker/pool_copier.py`); the
other ranks get the adapter's whole packed rows (`loraserve/pool_rows.py`, as the store sends them) in
the next step's message and copy their own parts into the same pages (`messages.Load`).
"""

from __future__ import annotations

import threading

import torch

from loraserve.model_config import ModelConfig
from loraserve.worker.adapters import LoraAdapter
from loraserve.worker.layer_progress import LayerProgress
from loraserve.worker.pool_copier import PoolCopier
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.tensor_parallel.messages import Load


class SharingCopier(PoolCopier):
    """Rank 0's pool copier: each adapter copy it makes is also queued, whole, for the other ranks (`drain`).
    Adapters are not packed ahead (`prepare`): the other ranks need the whole weights, not rank 0's part."""

    def __init__(self, layout: PoolLayout, model: ModelConfig, *args, **kwargs) -> None:
        super().__init__(layout, model, *args, **kwargs)
        self._loads: list[Load] = []
        self._lock = threading.Lock()

    def prepare(self, adapter: LoraAdapter) -> LoraAdapter:
        return adapter

    def copy(
        self, pages: tuple[int, ...], num_rows: int, adapter: LoraAdapter, progress: LayerProgress | None = None
    ) -> None:
        if progress is None:  # a copy now; a background one was queued when it started (`copy_in_background`)
            self._queue(pages, num_rows, adapter)
        super().copy(pages, num_rows, adapter, progress)

    def copy_in_background(
        self, pages: tuple[int, ...], num_rows: int, adapter: LoraAdapter, demand: bool
    ) -> LayerProgress:
        self._queue(pages, num_rows, adapter)
        return super().copy_in_background(pages, num_rows, adapter, demand)

    def drain(self) -> list[Load]:
        """The copies queued since the last drain, in the order they were made."""
        with self._lock:
            loads, self._loads = self._loads, []
        return loads

    def _queue(self, pages: tuple[int, ...], num_rows: int, adapter: LoraAdapter) -> None:
        rows = whole_rows(adapter, self.model, self.tensor.dtype)
        load = Load(
            pages=list(pages),
            num_rows=num_rows,
            rank=adapter.rank,
            lora_alpha=adapter.lora_alpha,
            use_rslora=adapter.use_rslora,
            modules=list(adapter.modules),
            layers=list(adapter.layers),
            dtype=str(rows.dtype).removeprefix("torch."),
            shape=list(rows.shape),
            rows=rows.contiguous().view(torch.uint8).numpy().tobytes(),
        )
        with self._lock:
            self._loads.append(load)


def whole_rows(adapter: LoraAdapter, model: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """The adapter's rows as one rank holds them all (`loraserve/pool_rows.py`), what the store sends."""
    whole = PoolLayout.for_model(model, rows_per_page=2, num_pages=1)
    return adapter.rows(whole, model, dtype)


def adapter_of(load: Load) -> LoraAdapter:
    """The adapter a Load carries, its rows as received (each rank packs its part from them)."""
    rows = torch.frombuffer(bytearray(load.rows), dtype=torch.uint8).view(getattr(torch, load.dtype))
    return LoraAdapter(
        rank=load.rank,
        lora_alpha=load.lora_alpha,
        use_rslora=load.use_rslora,
        modules=tuple(load.modules),
        layers=tuple(load.layers),
        weights={},
        config={},
        packed=rows.view(load.shape),
    )
