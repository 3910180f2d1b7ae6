"""Adapter copies on a tensor-parallel worker: rank 0's copier hands each other rank its part of the adapter.

Rank 0 copies its part of an adapter into its pool as any worker does (`worker/pool_copier.py`) and queues
the copy for the other ranks: the next step's message says which adapter went to which pages
(`messages.Load`), and each other rank then receives its own part's rows, point to point, and copies them
into the same pages. The parts come from the store, one fetch per rank (`worker/fetch_threads.py`), or,
for an adapter read from its files, are packed here (`prepare`, on a fetch thread).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from loraserve.model_config import ModelConfig
from loraserve.partition import Shard
from loraserve.worker.adapters import LoraAdapter
from loraserve.worker.layer_progress import LayerProgress
from loraserve.worker.pool_copier import PoolCopier
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.tensor_parallel.messages import Load


@dataclass(frozen=True)
class Handover:
    """One copy for the other ranks: what the step message says, and each rank's rows (rank k: rows[k - 1])."""

    load: Load
    rows: tuple[torch.Tensor, ...]


class SharingCopier(PoolCopier):
    """Rank 0's pool copier: each adapter copy it makes is also queued for the other ranks (`drain`)."""

    def __init__(self, layout: PoolLayout, model: ModelConfig, *args, **kwargs) -> None:
        super().__init__(layout, model, *args, **kwargs)
        size = layout.shard.size
        self.other_layouts = [dataclasses.replace(layout, shard=Shard(size, i)) for i in range(1, size)]
        self._queued: list[Handover] = []
        self._lock = threading.Lock()

    def prepare(self, adapter: LoraAdapter) -> LoraAdapter:
        """`adapter` with every rank's part packed: this rank's for its pool, the others' to hand over."""
        if not adapter.rank_rows:
            adapter = dataclasses.replace(adapter, rank_rows=self._other_rows(adapter))
        return super().prepare(adapter)

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

    def drain(self) -> list[Handover]:
        """The copies queued since the last drain, in the order they were made."""
        with self._lock:
            queued, self._queued = self._queued, []
        return queued

    def _other_rows(self, adapter: LoraAdapter) -> tuple[torch.Tensor, ...]:
        return tuple(adapter.pack(layout, self.model, self.tensor.dtype) for layout in self.other_layouts)

    def _queue(self, pages: tuple[int, ...], num_rows: int, adapter: LoraAdapter) -> None:
        rows = adapter.rank_rows or self._other_rows(adapter)
        load = Load(
            pages=list(pages),
            num_rows=num_rows,
            rank=adapter.rank,
            lora_alpha=adapter.lora_alpha,
            use_rslora=adapter.use_rslora,
            modules=list(adapter.modules),
            layers=list(adapter.layers),
            dtype=str(rows[0].dtype).removeprefix("torch."),
            shape=list(rows[0].shape),
        )
        with self._lock:
            self._queued.append(Handover(load, rows))


def adapter_of(load: Load, rows: torch.Tensor, shard: Shard) -> LoraAdapter:
    """The adapter a Load names, holding this rank's part of its rows as received."""
    return LoraAdapter(
        rank=load.rank,
        lora_alpha=load.lora_alpha,
        use_rslora=load.use_rslora,
        modules=tuple(load.modules),
        layers=tuple(load.layers),
        weights={},
        config={},
        packed=rows,
        packed_shard=shard,
    )
