"""Per-step metadata in storage allocated once: the kernels read views of it, at fixed addresses.

    buffers = StepBuffers(StepCapacity(...), device)       # once, sized from the engine's limits
    every step:
        ids = buffers.put("input_ids", [..])               # staged on the host; a view [:n] of the device table
        table = buffers.put("kv_page_table", flat, (B, w)) # contiguous [B, w] view of the same fixed storage
        buffers.upload()                                   # one copy per dtype (none on CPU)

There is one device tensor per dtype (int64, int32, float32) holding every table at a fixed
offset, and on CUDA one pinned host tensor per dtype that `put` fills from Python lists (through
numpy, without building a tensor per table); `upload` copies each dtype's staged span in one
`copy_`. On CPU the host tensor *is* the storage, so there is nothing to copy. A table's view
starts at the same address every step, which is what CUDA graph capture needs. A step larger
than the capacities raises `StepCapacityError`; nothing is ever truncated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from loraserve.model_config import LORA_MODULES


class StepCapacityError(ValueError):
    """A step needs more room than the step buffers were sized for."""


@dataclass(frozen=True)
class StepCapacity:
    """The largest step the buffers hold; every table's size is derived from these."""

    max_tokens: int  # tokens per step (the engine's token budget)
    max_seqs: int  # sequences per step (the engine's max batch size); also bounds segments
    max_seq_pages: int  # KV pages in one sequence's page table
    max_adapters: int  # distinct adapters per step
    max_adapter_pages: int  # pages of the largest adapter
    num_layers: int

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"StepCapacity.{f.name} must be >= 1, got {getattr(self, f.name)}")

    def check(self, **sizes: int) -> None:
        """Raise StepCapacityError if a size of this step (keyword = field name) exceeds its capacity."""
        for name, size in sizes.items():
            if size > getattr(self, name):
                raise StepCapacityError(
                    f"this step needs {name}={size} but the step buffers hold {getattr(self, name)}; "
                    "they are sized from the engine's limits, so a larger step is a scheduling bug"
                )


def _tables(c: StepCapacity) -> tuple[tuple[str, torch.dtype, int], ...]:
    """(name, dtype, entries) of every per-step table; within a dtype, the large tables last."""
    adapters, segments = c.max_adapters, c.max_seqs
    return (
        ("input_ids", torch.int64, c.max_tokens),
        ("positions", torch.int64, c.max_tokens),
        ("new_rows", torch.int64, c.max_tokens),
        ("last", torch.int64, c.max_seqs),  # the token whose logits each sampled sequence uses
        ("query_start", torch.int32, c.max_seqs + 1),
        ("context_len", torch.int32, c.max_seqs),
        ("seg_start", torch.int32, segments),
        ("seg_len", torch.int32, segments),
        ("seg_adapter", torch.int32, segments),
        ("token_adapter", torch.int32, c.max_tokens),
        ("rank", torch.int32, adapters),
        ("a_offset", torch.int32, adapters * len(LORA_MODULES)),
        ("b_offset", torch.int32, adapters * len(LORA_MODULES)),
        ("layer_active", torch.int32, adapters * c.num_layers),
        ("shrink_rank", torch.int32, adapters * len(LORA_MODULES)),
        ("shrink_a_offset", torch.int32, adapters * len(LORA_MODULES)),
        ("v_col", torch.int32, adapters * len(LORA_MODULES)),
        ("lora_page_table", torch.int32, adapters * c.max_adapter_pages),
        ("kv_page_table", torch.int32, c.max_seqs * c.max_seq_pages),
        ("scale", torch.float32, adapters),
    )


class StepBuffers:
    """Every per-step metadata table, allocated once on `device` and refilled in place each step.

    `put` stages a table and returns its device view; `upload` makes the staged values visible on
    the device (call it once per step, after the last `put` and before the kernels run). The views
    of one step stay valid until the next step's first `put`.
    """

    def __init__(self, capacity: StepCapacity, device: torch.device | str):
        self.capacity = capacity
        self.device = torch.device(device)
        self._region: dict[str, tuple[torch.dtype, int, int]] = {}  # name -> (dtype, offset, entries)
        totals: dict[torch.dtype, int] = {}
        for name, dtype, entries in _tables(capacity):
            self._region[name] = (dtype, totals.get(dtype, 0), entries)
            totals[dtype] = totals.get(dtype, 0) + entries
        self._storage = {dt: torch.zeros(n, dtype=dt, device=self.device) for dt, n in totals.items()}
        self._in_place = self.device.type == "cpu"  # the host arrays are the storage itself
        pinned = self.device.type == "cuda"
        host = (
            self._storage
            if self._in_place
            else {dt: torch.zeros(n, dtype=dt, pin_memory=pinned) for dt, n in totals.items()}
        )
        self._host_tensors = host  # kept alive: the numpy arrays below share their memory
        self._host = {dt: t.numpy() for dt, t in host.items()}
        self._end = dict.fromkeys(totals, 0)  # per dtype: staged entries lie in [0, end)
        self._copied: torch.cuda.Event | None = None  # the last upload, on CUDA

    def put(self, name: str, values: Sequence[int] | Sequence[float], shape: tuple[int, ...] | None = None):
        """Stage `values` (flat, row-major) as table `name`; returns its device view, shaped `shape`."""
        dtype, offset, entries = self._region[name]
        n = len(values)
        if n > entries:
            raise StepCapacityError(f"step table {name!r} needs {n} entries, the step buffers hold {entries}")
        if self._copied is not None:  # the host staging is still being read by the last upload
            self._copied.synchronize()
            self._copied = None
        self._host[dtype][offset : offset + n] = values
        self._end[dtype] = max(self._end[dtype], offset + n)
        view = self._storage[dtype][offset : offset + n]
        return view if shape is None else view.view(shape)

    def view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Table `name`'s device view, shaped `shape`, without staging anything: the fixed-address
        tensor a captured CUDA graph reads, whatever each step then stages there with `put`."""
        dtype, offset, entries = self._region[name]
        n = math.prod(shape)
        if n > entries:
            raise StepCapacityError(f"step table {name!r} needs {n} entries, the step buffers hold {entries}")
        return self._storage[dtype][offset : offset + n].view(shape)

    def upload(self) -> None:
        """Copy what this step staged to the device: one copy per dtype, none on CPU."""
        if not self._in_place:
            for dtype, end in self._end.items():
                if end:
                    self._storage[dtype][:end].copy_(self._host_tensors[dtype][:end], non_blocking=True)
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
        self._end = dict.fromkeys(self._end, 0)
