"""The worker's reports to the scheduler: its pool, queues, resident adapters, finished requests,
step samples (for the scheduler's step-cost fit) and cached-prefix fingerprints, in one `WorkerReport`.
The resident adapters and the fingerprints go out when they changed, and every few seconds in any case.

Pure bookkeeping between reports: the worker's core decides when to report and what of its requests it
carries (`effects.Report`); the service sends what `report` builds (through its I/O thread).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from loraserve.wire import MAX_PREFIXES, MAX_RESIDENT, MAX_STEP_SAMPLES, ResidentNews, WorkerReport
from loraserve.worker.engine import Engine

PREFIXES_MIN_S = 0.05  # cached-prefix fingerprints go out at most this often when they change ...
PREFIXES_RESEND_S = 2.0  # ... and this often when they do not


class Reporter:
    """What the next report carries besides the engine's state and the core's requests: steps taken since the
    last one, and when the prefix fingerprints last went out."""

    def __init__(self, engine: Engine, worker_id: str, instance: str) -> None:
        self.engine, self.worker_id, self.instance = engine, worker_id, instance
        self.step_samples: list[tuple[int, int, int, int, float]] = []  # (StepShape..., seconds) since then
        self._prefixes_sent = (-1, 0.0)  # (prefix epoch, monotonic time) of the last report that carried them
        self._resident = ResidentNews()  # the resident adapters go out when the set changed
        self.resident_count = 0  # adapters in the pool at the last report (read by the metrics endpoint's thread)

    def sample_step(self, seconds: float) -> None:
        """Keep the step's composition and time for the next report (the scheduler fits its cost model
        to them); past MAX_STEP_SAMPLES between reports, the oldest go."""
        shape = self.engine.last_step
        if shape is not None:
            self.step_samples.append((*shape, min(seconds, 3600.0)))
            del self.step_samples[:-MAX_STEP_SAMPLES]

    def report(
        self, ready: bool, draining: bool, waiting: list[str], fatal: str | None = None, finished: Sequence[str] = ()
    ) -> WorkerReport:
        """The report to send now (`waiting`: requests waiting for their adapter's fetch or matcher's build,
        `finished`: those ended since the last report, as the worker's core says: `effects.Report`)."""
        e = self.engine
        resident = e.pool.pages.resident_adapters()
        self.resident_count = len(resident)
        pool = e.pool.pages.stats()
        stats = e.pool.stats
        report = WorkerReport(
            worker_id=self.worker_id,
            ready=ready and fatal is None,
            max_batch_size=e.config.max_batch_size,
            total_pages=pool.total_pages,
            free_pages=pool.free_pages,
            kv_pages=pool.kv_pages,
            adapter_pages=pool.adapter_pages,
            running=[r.request_id for r in e.step_scheduler.running],
            waiting=[r.request_id for r in e.step_scheduler.waiting] + waiting,
            resident=self._resident.news(resident[-MAX_RESIDENT:], time.monotonic()),
            finished=list(finished),
            evictable_pages=e.pool.pages.evictable_pages() + pool.cached_pages,
            cached_pages=pool.cached_pages,
            tokens_per_page=e.layout.tokens_per_page,
            steps=e.steps,
            prefetch_hits=stats.prefetch_hits,
            prefetch_misses=stats.misses + stats.prefetch_late,
            waste_fraction=pool.waste_fraction,
            fatal=fatal,
            instance=self.instance,
            draining=draining,
            step_samples=self.step_samples,
            cached_prefixes=self._cached_prefixes(),
        )
        self.step_samples = []
        return report

    def _cached_prefixes(self) -> bytes | None:
        """The pool's cached-prefix fingerprints when they changed (at most every PREFIXES_MIN_S), and
        every PREFIXES_RESEND_S in any case (a scheduler that restarted learns them); else None."""
        epoch, now = self.engine.pool.pages.prefixes.epoch, time.monotonic()
        sent_epoch, sent_at = self._prefixes_sent
        if now - sent_at < (PREFIXES_MIN_S if epoch != sent_epoch else PREFIXES_RESEND_S):
            return None
        self._prefixes_sent = epoch, now
        return b"".join(self.engine.pool.pages.prefixes.fingerprints(MAX_PREFIXES))
