"""What rank 0 tells the other ranks of a tensor-parallel worker: msgspec Structs over msgpack, never pickled.

Setup   once, first: the model and the engine config; each rank loads its part of the weights
Ready   once, when rank 0's runner is built: the pool's pages and the scratch page padded decode steps
        use (None: no padding); each rank builds its pool and runner
Step    every step: the adapters copied in since the last one (each rank's part of their rows then follows,
        to that rank alone: `Channel.send_rows`), then the step's sequences as the runner sees them
        (`SeqChunk` without what only rank 0 uses: sampling, prompt scoring)
Stop    the worker is closing
"""

from __future__ import annotations

import msgspec


class Setup(msgspec.Struct, tag=True):
    model_dir: str
    engine: dict  # EngineConfig's fields


class Ready(msgspec.Struct, tag=True):
    pool_pages: int
    scratch_page: int | None


class Load(msgspec.Struct):
    """An adapter copied into `pages`: its config, and the type and shape of the rows of each rank's part
    [layers, rows, KV width] (the same on every rank), which follow the message point to point."""

    pages: list[int]
    num_rows: int  # of this rank's part (the same on every rank)
    rank: int
    lora_alpha: float
    use_rslora: bool
    modules: list[str]
    layers: list[int]
    dtype: str  # a torch dtype name
    shape: list[int]


class Slot(msgspec.Struct, array_like=True):
    """An adapter's place in the pool, as the LoRA kernels read it (`kernels.batch.PooledAdapter`)."""

    rank: int
    scale: float
    pages: list[int]
    a_offsets: list[int]
    b_offsets: list[int]
    layers: list[bool]

    @property
    def row_dtype(self) -> None:
        """A split model holds its adapters at the pool's dtype (`worker/config.py` refuses half rows)."""
        return None


class Chunk(msgspec.Struct, array_like=True):
    token_ids: list[int]
    start: int
    kv_pages: list[int]
    slot: int  # index into Step.slots; -1: no adapter


class Step(msgspec.Struct, tag=True):
    loads: list[Load]
    slots: list[Slot]
    chunks: list[Chunk]
    kv_copies: list[tuple[int, int]]


class Stop(msgspec.Struct, tag=True):
    pass


Message = Setup | Ready | Step | Stop
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Message)
