"""The worker's Prometheus metrics (served when it runs with --metrics-port).

Pool figures are read at scrape time from the last report the worker sent the scheduler (it
builds one after every step), the pool's adapter counters from its stats object and the host-RAM
adapter cache's size and evictions from the cache itself (plain ints), so the engine loop pays
nothing for them. Step times are observed in the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loraserve.wire import WorkerReport

STEP_SECONDS = Histogram(
    "loraserve_worker_step_seconds",
    "Duration of one engine step (one forward over the batch)",
    ["worker"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)

ADAPTER_REQUESTS = Counter(
    "loraserve_worker_adapter_requests",
    "Requests for an adapter, by how they found it on arrival: resident (no load), ready (a prefetch had "
    "loaded it), loading (its fetch or copy was under way), cold (its load started with the request)",
    ["worker", "found"],
)

# adapter-cache counters: (metric name, help, key in the loader's stats)
ADAPTER_COUNTERS = (
    ("loraserve_worker_adapter_loads", "Adapters copied into the pool", "loads"),
    ("loraserve_worker_adapter_misses", "Requests that waited for their adapter's load", "misses"),
    ("loraserve_worker_adapter_evictions", "Adapters evicted from the pool", "evictions"),
    ("loraserve_worker_prefetches", "Adapter loads started ahead of need", "prefetches"),
    ("loraserve_worker_prefetch_hits", "Adapters needed that a prefetch had made ready", "prefetch_hits"),
    ("loraserve_worker_prefetch_late", "Adapters needed while their prefetch was still copying", "prefetch_late"),
)


class HostCache(Protocol):
    """What the collector reads of the worker's host-RAM adapter cache (an AdapterRegistry)."""

    evictions: int
    budget_bytes: int | None

    @property
    def nbytes(self) -> int: ...


class WorkerCollector(Collector):
    def __init__(
        self,
        last_report: Callable[[], WorkerReport | None],
        adapter_stats: object,
        host_cache: HostCache,
        step_scheduler: object = None,
        *,
        resident_count: Callable[[], int],
    ):
        self.last_report, self.adapter_stats, self.host_cache = last_report, adapter_stats, host_cache
        self.step_scheduler = step_scheduler  # its shared_prefill_tokens (an int)
        self.resident_count = resident_count  # adapters in the pool (a report names them only when they change)

    def collect(self) -> Iterator:
        report = self.last_report()
        if report is None:
            return
        counters = dict(vars(self.adapter_stats))
        worker = [report.worker_id]
        pages = GaugeMetricFamily("loraserve_worker_pool_pages", "Unified pool pages by use", labels=["worker", "use"])
        uses = (("kv", report.kv_pages), ("adapter", report.adapter_pages), ("free", report.free_pages))
        for use, value in (*uses, ("cached", report.cached_pages)):
            pages.add_metric([*worker, use], value)
        yield pages
        for name, doc, value in (
            ("loraserve_worker_pool_waste_fraction", "Unused share of allocated pages", report.waste_fraction),
            ("loraserve_worker_running_requests", "Requests in the running batch", len(report.running)),
            ("loraserve_worker_waiting_requests", "Requests assigned but not running yet", len(report.waiting)),
            ("loraserve_worker_resident_adapters", "Adapters in the pool", self.resident_count()),
            ("loraserve_worker_ready", "1 when the worker accepts requests", int(report.ready)),
            ("loraserve_worker_host_cache_bytes", "Host RAM held by cached adapter weights", self.host_cache.nbytes),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["worker"])
            gauge.add_metric(worker, value)
            yield gauge
        steps = CounterMetricFamily("loraserve_worker_steps", "Engine steps run", labels=["worker"])
        steps.add_metric(worker, report.steps)
        yield steps
        evictions = CounterMetricFamily(
            "loraserve_worker_host_cache_evictions", "Adapters dropped from host RAM over its budget", labels=["worker"]
        )
        evictions.add_metric(worker, self.host_cache.evictions)
        yield evictions
        shared = CounterMetricFamily(
            "loraserve_worker_shared_prefill_tokens",
            "Prompt tokens whose KV was copied from a request of their prefill group (n choices) instead of computed",
            labels=["worker"],
        )
        shared.add_metric(worker, getattr(self.step_scheduler, "shared_prefill_tokens", 0))
        yield shared
        for name, doc, key in ADAPTER_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["worker"])
            counter.add_metric(worker, counters.get(key, 0))
            yield counter
        if self.step_scheduler is not None:
            yield from self._prefix_cache(worker)

    def _prefix_cache(self, worker: list[str]) -> Iterator:
        """Prefix caching: hit and looked-up tokens (their ratio is the hit rate), idle cached pages, and
        cached pages reclaimed for other use."""
        scheduler, pool = self.step_scheduler, self.step_scheduler.pool
        for name, doc, value in (
            (
                "loraserve_worker_prefix_cache_hit_tokens",
                "Tokens whose KV admission found cached",
                scheduler.cached_tokens,
            ),
            (
                "loraserve_worker_prefix_cache_query_tokens",
                "Tokens of the requests admitted with the prefix cache on (hit rate: hits / these)",
                scheduler.admitted_tokens,
            ),
            (
                "loraserve_worker_prefix_cache_evictions",
                "Idle cached KV pages reclaimed for other use",
                pool.pages.prefixes.evictions,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["worker"])
            counter.add_metric(worker, value)
            yield counter
        gauge = GaugeMetricFamily(
            "loraserve_worker_prefix_cache_pages",
            "KV pages registered in the prefix cache (held or idle)",
            labels=["worker"],
        )
        gauge.add_metric(worker, pool.pages.prefixes.registered_count())
        yield gauge
