"""The store's copy of each version in the pool's row layout: packed once, sent to every worker as it is.

`RowsMaker` packs a validated adapter (`loraserve/pool_rows.py`, numpy) into shared memory when the host
allows it (`loraserve/shared_memory.py`), else into RAM, and computes each layer's sha256. `PackedRows` is
what the data plane sends: over the socket (zero-copy from the same buffer) or, to a worker on this host,
as the name of the file. A tensor-parallel rank asks for its part of them (`part`): cut from them for that
reply, in RAM, and sent over the socket. The rows are a derived copy of the weights file the store also
keeps: they cost about as much RAM again (shared memory counts as RAM), counted in the store's memory budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loraserve.adapter_format import CheckedAdapter
from loraserve.model_config import ModelConfig
from loraserve.partition import Shard, check_partition
from loraserve.pool_rows import RowsSpec, layer_digests, pack_rows, rows_spec, shard_rows
from loraserve.shared_memory import SharedMemoryUnavailable, SharedRowsDir, SharedRowsFile

log = logging.getLogger(__name__)


@dataclass
class PackedRows:
    """One version's rows, their layer digests, and where they are: in RAM, or in a shared-memory file
    (mapped only while read: the store holds no descriptor per version)."""

    spec: RowsSpec
    rank: int
    modules: tuple[str, ...]
    layers: tuple[int, ...]
    digests: list[str]
    memory: memoryview | None = field(default=None, repr=False)  # the rows' bytes in RAM, without a file
    file: SharedRowsFile | None = field(default=None, repr=False)

    @property
    def buffer(self) -> memoryview:
        """The rows' bytes: in RAM, or the file mapped now (released with the view; FileNotFoundError once
        the version was purged)."""
        return self.file.rows if self.file is not None else self.memory

    def release(self) -> None:
        """The version is gone: remove its file (mappings, the store's own included, end when unused)."""
        if self.file is not None:
            self.file.unlink()


class RowsMaker:
    """Packs validated adapters for the store's model, into shared memory under `shm_root` when it can."""

    def __init__(self, model: ModelConfig, shm_root: Path | None):
        self.model = model
        self.shared: SharedRowsDir | None = None
        if shm_root is not None:
            try:
                self.shared = SharedRowsDir(shm_root)
            except SharedMemoryUnavailable as e:
                log.warning("adapter rows go over sockets only: %s", e)

    def pack(self, checked: CheckedAdapter, sha256: str) -> PackedRows:
        """The adapter's rows and layer digests: in a shared-memory file, or in RAM when there is none or it
        cannot be made (a full tmpfs: workers then get these rows over the socket)."""
        spec = rows_spec(self.model, checked)
        file = None
        if self.shared is not None:
            try:
                file = self.shared.create(spec.nbytes, sha256)
            except OSError as e:
                log.warning("adapter rows (%d bytes) kept in RAM, not in shared memory: %s", spec.nbytes, e)
        buffer = file.rows if file is not None else memoryview(bytearray(spec.nbytes))  # a file: mapped for now
        pack_rows(checked, self.model, np.frombuffer(buffer, dtype=np.uint8))
        digests = layer_digests(buffer, spec)
        memory = None if file is not None else buffer
        return PackedRows(spec, checked.config.rank, checked.modules, checked.layers, digests, memory, file)

    def part(self, rows: PackedRows, shard: Shard) -> PackedRows:
        """The part of `rows` that tensor-parallel rank `shard` holds (`pool_rows.shard_rows`), cut now into
        RAM for one reply; InvalidConfigError when the store's model cannot be split over that many ranks,
        FileNotFoundError when the version was purged meanwhile."""
        check_partition(self.model, shard.size)
        spec, buffer = shard_rows(rows.buffer, rows.spec, self.model, rows.rank, rows.modules, rows.layers, shard)
        digests = layer_digests(buffer, spec)
        return PackedRows(spec, rows.rank, rows.modules, rows.layers, digests, memory=memoryview(buffer))

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
