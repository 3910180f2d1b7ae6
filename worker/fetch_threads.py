"""A worker's adapter fetches, on background threads: from the store to an adapter ready to copy into the pool.

Each fetch thread keeps its own `AdapterFetcher` (a ZMQ socket is used by one thread only). A fetch asks
the store for the adapter in the pool's row layout (`FetchConfig.adapter_rows`): the rows are checked for
this pool (`worker/adapter_rows.py`) and held as they arrived, mapped from the store's shared memory when
both share a host and a user. A tensor-parallel worker's rank 0 fetches each rank's part of the rows (the
store cuts them) and hands the others theirs when it loads the adapter (`tensor_parallel/loads.py`). From a
store that sends files (or with rows off) the files are parsed, validated and packed here, as before.
Either way the step loop only registers the result and copies it.

A finished fetch is queued in `results` and wakes the step loop at once (`Wakeup`): an idle loop otherwise
sleeps up to its poll interval (50 ms) before it looks, which a cold request would pay in its TTFT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from loraserve.adapter_store.client import AdapterFetcher, FetchedAdapter, FetchedRows
from loraserve.errors import LoraserveError
from loraserve.partition import Shard, local_model
from loraserve.shared_memory import user_dir
from loraserve.wire import AdapterKey
from loraserve.worker.adapter_rows import rows_adapter
from loraserve.worker.adapters import LoraAdapter, load_adapter_bytes
from loraserve.worker.config import FetchConfig
from loraserve.worker.engine import Engine
from loraserve.worker.fetch_queue import FetchQueue

log = logging.getLogger(__name__)


@dataclass
class Fetched:
    """A fetch's outcome: the adapter ready to load, or the error to fail its requests with."""

    key: AdapterKey
    adapter: LoraAdapter | None = None
    error: LoraserveError | None = None
    seconds: float = 0.0
    for_prefetch: bool = False
    source: str = ""  # "shared-memory" | "rows" | "files"
    waiting: list[str] = field(default_factory=list)


class Wakeup:
    """A pipe the step loop polls beside its sockets; any thread may `wake` it, even after `close` (a fetch
    still running when the worker stops): then nothing is written, never to a descriptor reused since."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):  # already full of wake-ups: the loop will look anyway
                os.write(self._write, b"\0")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self.fd)
            os.close(self._write)


class FetchThreads:
    """Fetch threads feeding `results` (see the module docstring), taking fetches from a `FetchQueue`:
    a request's fetch before any prefetch."""

    def __init__(self, config: FetchConfig, engine: Engine, wakeup: Wakeup):
        self.config, self.engine, self.wakeup = config, engine, wakeup
        self.results: queue.Queue[Fetched] = queue.Queue()
        self.queue = FetchQueue()
        self._local = threading.local()
        for i in range(config.fetch_threads):
            threading.Thread(target=self._run, name=f"adapter-fetch-{i}", daemon=True).start()

    def submit(self, key: AdapterKey, for_prefetch: bool, trace: dict | None) -> None:
        self.queue.put(key, demand=not for_prefetch, trace=trace)

    def promote(self, key: AdapterKey) -> bool:
        """A request now waits for `key`: a queued prefetch of it goes ahead of the other prefetches."""
        return self.queue.promote(key)

    def close(self) -> None:
        self.queue.close()  # queued fetches are dropped; those under way end on their own

    def _run(self) -> None:
        while (job := self.queue.take()) is not None:
            self._fetch(job.key, not job.demand, job.trace)

    def _fetcher(self) -> AdapterFetcher:
        fetcher = getattr(self._local, "fetcher", None)
        if fetcher is None:
            c = self.config
            shared = user_dir(c.shm_root) if c.adapter_rows and c.shm_root is not None else None
            fetcher = AdapterFetcher(
                c.store_address,
                c.fetch_timeout_s,
                curve=c.curve,
                shared_memory=shared,
                verify_shared=c.verify_shared_memory,
            )
            self._local.fetcher = fetcher
        return fetcher

    def _fetch(self, key: AdapterKey, for_prefetch: bool, trace: dict | None) -> None:
        start = time.perf_counter()
        result = Fetched(key, for_prefetch=for_prefetch)
        try:
            result.adapter, result.source = self._load(key, trace)
        except LoraserveError as e:
            result.error = e
        except Exception as e:  # never let a fetch thread die silently
            log.exception("fetching adapter %s v%d failed", *key)
            result.error = LoraserveError(f"fetching adapter {key[0]} v{key[1]} failed: {e}")
        result.seconds = time.perf_counter() - start
        self.results.put(result)
        self.wakeup.wake()

    def _load(self, key: AdapterKey, trace: dict | None) -> tuple[LoraAdapter, str]:
        """The adapter, checked and ready to copy into the pool, and how it came."""
        e = self.engine
        model, max_rank = e.model_config, e.config.max_lora_rank
        # The files' weights are checked against their sha256 as they arrive.
        got = self._rows(key, trace) if self.config.adapter_rows else self._fetcher().fetch_adapter(*key, trace=trace)
        if isinstance(got, list):
            parts = [rows_adapter(rows, model, max_rank, Shard(len(got), i)) for i, rows in enumerate(got)]
            adapter = dataclasses.replace(parts[0], rank_rows=tuple(part.packed for part in parts[1:]))
            return e.pool.copier.prepare(adapter), "shared-memory" if got[0].shared else "rows"
        adapter = load_adapter_bytes(got.config_json, got.weights, model, max_rank, got.weights_format, got.sha256)
        return e.pool.copier.prepare(adapter), "files"  # packed here, so that loading it is only a copy

    def _rows(self, key: AdapterKey, trace: dict | None) -> list[FetchedRows] | FetchedAdapter:
        """The adapter's rows, one fetch per tensor-parallel rank (each rank's part: what rank 0 hands the
        others at a load), or its files when the store sends no rows for this model."""
        model, shard = self.engine.model_config, self.engine.layout.shard
        parts = []
        for i in range(shard.size):
            part = Shard(shard.size, i)
            width = local_model(model, part).kv_width
            got = self._fetcher().fetch_rows(key[0], key[1], width, model.num_layers, trace=trace, shard=part)
            if not isinstance(got, FetchedRows):
                return got
            parts.append(got)
        return parts
