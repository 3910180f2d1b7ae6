"""`loraserve worker`'s own settings (the engine's are EngineConfig's), light enough for `loraserve up` to read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraserve.config_cli import directory_setting, setting
from loraserve.process import DRAIN_TIMEOUT_S


@dataclass(frozen=True)
class WorkerSettings:
    """`loraserve worker`'s own settings (the engine's are EngineConfig's); `serve` makes a WorkerConfig of them."""

    worker_id: str | None = setting(None, "unique name (default: host-pid)")
    scheduler_address: str = setting("tcp://127.0.0.1:7101", "the scheduler's ZMQ worker address")
    store_address: str = setting("tcp://127.0.0.1:7301", "the adapter store's ZMQ data address")
    report_interval: float = setting(0.25, "seconds between state reports when idle (busy: one after every step)")
    drain_timeout: float = setting(
        DRAIN_TIMEOUT_S, "on SIGTERM, seconds to let requests in flight finish before handing them back to fail over"
    )
    fetch_timeout: float = setting(10.0, "seconds to wait for an adapter from the store")
    fetch_threads: int = setting(2, "threads fetching adapters from the store")
    adapter_rows: bool = setting(
        True,
        "fetch adapters already packed in the pool's row layout when the store has them, instead of their "
        "files to parse, validate and pack here (--no-adapter-rows: the files)",
    )
    shm_root: Path | None = directory_setting(
        Path("/dev/shm"),
        "the store's --shared-memory-root: rows of a store on this host and user are mapped from there, "
        "not received over the socket; empty: the socket only",
        flag="--shared-memory-root",
    )
    verify_shared_memory: bool = setting(
        False,
        "hash rows mapped from shared memory against the store's digests too (rows over the socket always are)",
    )
    torch_threads: int | None = setting(
        None, "torch intra-op CPU threads (default: torch's choice; fewer when other roles share the CPU)"
    )
    heartbeat_interval: float = setting(
        0.25, "seconds between heartbeats to the scheduler, sent by the I/O thread however long a step takes"
    )
    grammar_threads: int = setting(2, "threads building structured-output matchers (and first masks) off the step loop")
