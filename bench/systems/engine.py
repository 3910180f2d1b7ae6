"""loraserve's in-process engine as a benchmark system, and its ablations (S-LoRA §7.2's variants).

    loraserve                  unified pool (KV and adapters share pages), segmented LoRA kernels
    loraserve-no-unified-pool  adapters get a fixed share of the pages, KV the rest
    loraserve-bmm              gather every adapter padded to the largest rank, then one bmm

The engine is driven in real time: requests are added when their arrival time comes, and
`engine.step()` runs in a loop while anything is queued or running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.systems.base import LastRunStats, Replay, ReplayLimits, RequestRecord
from loraserve.bench.workloads.slora import Trace
from loraserve.model_config import ModelConfig
from loraserve.worker.adapters import LoraAdapter, load_adapter_bytes
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.sampling import SamplingParams

WASTE_SAMPLE_EVERY = 4  # steps between samples of the pool's waste fraction


class AdapterBank:
    """Validated adapters in host memory, built once from their files' bytes and shared by engines."""

    def __init__(self, adapters: SyntheticAdapters, max_rank: int = 128):
        self.adapters = adapters
        self.model = ModelConfig.from_dir(adapters.model_dir)
        self.max_rank = max_rank
        self._cache: dict[tuple[str, int], LoraAdapter] = {}

    def get(self, name: str, rank: int) -> LoraAdapter:
        key = (name, rank)
        if key not in self._cache:
            config, weights = self.adapters.files(name, rank)
            self._cache[key] = load_adapter_bytes(config, weights, self.model, self.max_rank)
        return self._cache[key]


@dataclass
class EngineSystem(LastRunStats):
    name: str
    model_dir: Path
    config: EngineConfig
    bank: AdapterBank
    limits: ReplayLimits = field(default_factory=ReplayLimits)

    def run(self, trace: Trace) -> list[RequestRecord]:
        with closing(warmed_engine(self.model_dir, self.config, self.bank, trace.adapters)) as engine:
            return self._replay(engine, trace)

    def _replay(self, engine: Engine, trace: Trace) -> list[RequestRecord]:
        replay = Replay(trace, self.name, self.limits)
        waste, batch_sizes, steps0, counters0 = [], [], engine.steps, adapter_counters(engine)
        replay.start()
        while not replay.done:
            for r in replay.due():
                sampling = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True, seed=0)
                try:
                    engine.add_request(list(r.prompt_ids), sampling, r.adapter, r.request_id)
                except Exception as e:  # an invalid request is a failed request, not a crashed benchmark
                    replay.finish(r.request_id, error=str(e))
            if not engine.has_unfinished():
                replay.wait_for_arrival()
                continue
            outputs = engine.step()
            now = replay.now()
            batch_sizes.append(len(outputs))  # requests that got a token (or finished) this step
            for out in outputs:
                replay.tokens(out.request_id, len(out.new_token_ids), now)
                if out.finished:
                    replay.finish(out.request_id, now, out.error)
            if (engine.steps - steps0) % WASTE_SAMPLE_EVERY == 0:
                waste.append(engine.stats()["pool"]["waste_fraction"])
        for request_id in list(engine.requests):  # past the deadline: stop what is left
            engine.abort(request_id)
        if engine.has_unfinished():
            engine.step()
        self._stats = {
            "pool_waste_fraction": sum(waste) / len(waste) if waste else 0.0,
            **adapter_stats_since(engine, counters0),
            "steps": engine.steps - steps0,
            "mean_batch_size": sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0,
        }
        return replay.results()


def warmed_engine(
    model_dir: Path,
    config: EngineConfig,
    bank: AdapterBank,
    adapters: dict[str, int],
    then: Callable[[Engine], object] = lambda engine: None,
) -> Engine:
    """An engine on `model_dir` with `adapters` (name -> rank) registered from `bank` and warmed up (`warm_up`),
    then `then(engine)` done (e.g. every adapter made resident); closed if any of it fails."""
    engine = Engine(model_dir, config)
    try:
        for name, rank in adapters.items():
            engine.adapters.add(name, bank.get(name, rank))
        warm_up(engine, adapters)
        then(engine)
    except BaseException:
        engine.close()
        raise
    return engine


def warm_up(engine: Engine, adapters: dict[str, int]) -> None:
    """Short requests before the clock starts, so first-call costs are not charged to the trace.

    One adapter of each rank alone, then all of them in one batch (or the base model alone when
    there are none): on a GPU that compiles the kernel variant of each rank block, prefill and decode.
    """
    one_per_rank = warm_up_adapters(adapters) or [None]
    sampling = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for batch in [[name] for name in one_per_rank] + ([one_per_rank] if len(one_per_rank) > 1 else []):
        for i, name in enumerate(batch):
            engine.add_request([5, 6, 7, 8], sampling, name, f"warm-up-{i}")
        while engine.has_unfinished():
            engine.step()


def warm_up_adapters(adapters: dict[str, int]) -> list[str]:
    """The adapters `warm_up` runs: the last one named of each rank."""
    return list({rank: name for name, rank in adapters.items()}.values())


ADAPTER_COUNTERS = ("loads", "misses", "evictions", "prefetches", "prefetch_hits", "prefetch_late", "load_seconds")


def adapter_counters(engine: Engine) -> dict[str, float]:
    """A snapshot of the engine's cumulative adapter counters."""
    adapters = engine.stats()["adapters"]
    return {k: adapters[k] for k in ADAPTER_COUNTERS}


def adapter_stats_since(engine: Engine, before: dict[str, float]) -> dict:
    """Adapter loads, misses, evictions and prefetch hit rate since the snapshot `before`
    (hit rate: prefetched and ready / adapters needed, whether ready, late or missed)."""
    delta = {k: v - before[k] for k, v in adapter_counters(engine).items()}
    needed = delta["prefetch_hits"] + delta["prefetch_late"] + delta["misses"]
    return {
        "adapter_loads": delta["loads"],
        "adapter_misses": delta["misses"],
        "adapter_evictions": delta["evictions"],
        "prefetches": delta["prefetches"],
        "prefetch_hit_rate": round(delta["prefetch_hits"] / needed, 3) if needed else None,
        "adapter_load_s": round(delta["load_seconds"], 4),
    }


LORASERVE_VARIANTS = ("loraserve", "loraserve-no-unified-pool", "loraserve-bmm")


def engine_variant(
    name: str, model_dir: Path, base: EngineConfig, bank: AdapterBank, limits: ReplayLimits, split_fraction: float
) -> EngineSystem:
    """One of LORASERVE_VARIANTS: `base` with the ablation's single change."""
    changes = {
        "loraserve": {},
        "loraserve-no-unified-pool": {"adapter_pool_fraction": split_fraction},
        "loraserve-bmm": {"backend": "torch-bmm"},
    }[name]
    return EngineSystem(name, model_dir, dataclasses.replace(base, **changes), bank, limits)
