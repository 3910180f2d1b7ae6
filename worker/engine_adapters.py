"""The engine's adapters: registration and versions (in host RAM, `AdapterRegistry`), each version's
weights identity for prefix caching, and prefetches into the pool.

`Engine` holds one `EngineAdapters` as `engine.adapters`: callers register validated adapters
(`engine.adapters.add`), unregister them and prefetch them here; `Engine.register_adapter` validates one
from a PEFT directory or its files' bytes first.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from loraserve.errors import AdapterNotFoundError
from loraserve.model_config import ModelConfig
from loraserve.prefix_keys import adapter_identity
from loraserve.wire import AdapterKey
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.adapters import LoraAdapter, load_adapter_bytes, load_adapter_dir
from loraserve.worker.config import EngineConfig
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.unified_pool import UnifiedPool

log = logging.getLogger(__name__)


class EngineAdapters:
    """Validated adapters and their versions, and the rule for prefetching them into the pool."""

    def __init__(
        self,
        config: EngineConfig,
        model: ModelConfig,
        layout: PoolLayout,
        registry: AdapterRegistry,
        pool: UnifiedPool,
        queued: Callable[[], Iterable[AdapterKey | None]],
    ) -> None:
        self.config, self.model, self.layout, self.registry, self.pool = config, model, layout, registry, pool
        self._queued = queued  # adapters of the requests waiting, in queue order
        self._ids: dict[AdapterKey, str] = {}  # weights' identity per version, for prefix caching

    def load(
        self,
        path: str | Path | None,
        config_json: bytes | str | None,
        weights: bytes | memoryview | None,
        weights_format: str,
    ) -> LoraAdapter:
        """Validate an adapter from a PEFT directory or from its files' bytes."""
        if path is not None:
            return load_adapter_dir(path, self.model, self.config.max_lora_rank)
        if config_json is not None and weights is not None:
            return load_adapter_bytes(config_json, weights, self.model, self.config.max_lora_rank, weights_format)
        raise ValueError("register_adapter needs a path, or config_json and weights")

    def add(self, name: str, adapter: LoraAdapter, version: int | None = None) -> AdapterKey:
        """Register an adapter that is already validated: a new version of `name`."""
        previous = self.registry.latest(name) if name in self.registry.names() else None
        key = self.registry.register(name, adapter, version)
        self._ids[key] = adapter.sha256 or uuid.uuid4().hex  # a registration of unknown weights: its own
        if previous is not None and previous != key:
            self.pool.discard_stale(previous)
        log.info("adapter %s v%d: rank %d on %s", name, key[1], adapter.rank, ",".join(adapter.modules))
        return key

    def unregister(self, name: str) -> None:
        key = self.registry.latest(name)
        self.registry.unregister(name)
        self.pool.discard_stale(key)

    def resolve(self, adapter: str | AdapterKey | None) -> AdapterKey | None:
        """An adapter name (its latest version) or an exact (name, version) as the key; None for the base."""
        if not adapter:
            return None
        if isinstance(adapter, str):
            return self.registry.latest(adapter)
        if not self.registry.has(adapter):
            raise AdapterNotFoundError(f"{adapter[0]} v{adapter[1]}", self.registry.names())
        return adapter

    def identity(self, key: AdapterKey | None) -> str:
        """What a cached KV block's adapter is: name, version and weights (`loraserve/prefix_keys.py`)."""
        return "" if key is None else adapter_identity(key[0], key[1], self._ids.get(key, ""))

    def prefetch(
        self, adapters: Sequence[str | AdapterKey], scores: Sequence[float] | None = None, demand: bool = False
    ) -> list[AdapterKey]:
        """Start copying these adapters (names mean their latest version; unknown ones are skipped) into the
        pool in the background.

        `scores`: the predicted likelihood that each is needed here soon, remembered per adapter
        (also for adapters not registered yet); a prefetch evicts only idle adapters with a lower
        score (`UnifiedPool`). Does nothing when the engine's `prefetch` is off, unless `demand`:
        the adapters were just fetched for requests that wait on them (a cold load, not a prediction,
        copied in the background all the same).
        """
        if not (self.config.prefetch or demand):
            return []
        keys: list[AdapterKey | None] = []
        for a in adapters:
            try:
                keys.append(self.registry.latest(a) if isinstance(a, str) else a)
            except AdapterNotFoundError:
                keys.append(None)
        if scores is not None:
            self.pool.remember_scores((k, s) for k, s in zip(keys, scores, strict=True) if k is not None)
        return self.start([k for k in keys if k is not None and self.registry.has(k)], demand)

    def start(self, keys: list[AdapterKey], demand: bool = False) -> list[AdapterKey]:
        """Copy `keys` into the pool in the background, never evicting what queued requests need."""
        if not keys:
            return []
        needed = frozenset(key for key in self._queued() if key is not None)
        reserve = int(self.layout.num_pages * self.config.prefetch_reserve)
        return self.pool.prefetch(keys, reserve, needed, demand)
