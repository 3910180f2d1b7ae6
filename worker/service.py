"""The worker process's step loop: feeds the worker's core and carries out its effects.

Everything that touches the engine runs on this one thread. Between steps it hands the core
(`worker/core.py`: every rule — assign, park, cancel, deadlines, delivery, reports) what arrived, with
the time: the scheduler's messages (received and decoded on the I/O thread, `worker/io_thread.py`), that
thread's news, finished adapter fetches (`fetch_threads.py`) and matcher builds (`guide_builds.py`); then
it runs a step and gives the core its outputs. The core answers with effects (`worker/effects.py`), done
here in order through one table: sends to the I/O thread (the loop never touches a socket), starts and
aborts to the engine, fetches and builds to their threads. Liveness does not depend on this loop: the I/O
thread sends the scheduler a heartbeat every `heartbeat_interval_s`, however long a step takes. On SIGTERM
(`stop`) the core drains, and the loop runs until it says so.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import zmq

from loraserve.dispatch import Dispatcher
from loraserve.errors import LoraserveError
from loraserve.params import SamplingParams
from loraserve.wire import WorkerReport
from loraserve.worker import effects, metrics
from loraserve.worker.config import WorkerConfig
from loraserve.worker.core import EngineAnswers, WorkerCore
from loraserve.worker.effects import Now
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.fetch_threads import FetchThreads, Wakeup
from loraserve.worker.guide_builds import GuideBuilds
from loraserve.worker.io_thread import WorkerIO
from loraserve.worker.reporter import Reporter

log = logging.getLogger(__name__)


class WorkerService:
    """The loop around one `WorkerCore`: messages in, engine steps, effects out (see the module docstring)."""

    def __init__(self, engine: Engine, config: WorkerConfig):
        self.engine, self.config, worker_id = engine, config, config.worker_id
        self.ctx = zmq.Context()
        self._wakeup, self.instance = Wakeup(), uuid.uuid4().hex  # wakes the loop; tells restarted workers apart
        curves = config.curve_to("scheduler"), config.curve_to("gateway"), self.instance, config.heartbeat_interval_s
        self.io = io = WorkerIO(self.ctx, config.scheduler_address, worker_id, self._wakeup, *curves)
        self._fetches = FetchThreads(config.fetching(), engine, self._wakeup)
        self.guides = GuideBuilds(engine.grammars, self._wakeup, config.grammar_threads)
        answers = EngineAnswers(engine.cached, engine.pool.standing, engine.registry.has)
        intervals = config.report_interval_s, config.drain_timeout_s
        self.core = WorkerCore(worker_id, answers, engine.config.prefetch, *intervals)
        self.cores = config.step_cores()  # `--cpu-cores` while stepping, anywhere while waiting for work
        self.reporter = Reporter(engine, worker_id, self.instance)
        self.last_report: WorkerReport | None = None  # read by the metrics endpoint's thread
        self._step_seconds = metrics.STEP_SECONDS.labels(worker_id)  # its series exists before the first step
        self._effects = Dispatcher(
            {
                effects.Send: lambda e: io.to_gateway(e.address, e.message, e.going_on),
                effects.Report: self._report,
                effects.Start: self._start,
                effects.Abort: lambda e: engine.abort(e.request_id, e.error),
                effects.Fetch: lambda e: self._fetches.submit(e.key, e.for_prefetch, e.trace),
                effects.Promote: lambda e: self._fetches.promote(e.key),
                effects.Build: lambda e: self.guides.submit(e.request_id, e.grammar, e.output_ids),
                effects.Forget: lambda e: self.guides.cancel(e.request_id),
                effects.Register: lambda e: engine.adapters.add(e.key[0], e.adapter, e.key[1]),
                effects.CopyIn: lambda e: engine.adapters.prefetch(e.keys, e.scores, e.demand),
                effects.AdapterRequested: lambda e: metrics.ADAPTER_REQUESTS.labels(worker_id, e.found).inc(),
                effects.Ended: lambda e: e.tracked.record_spans(worker_id, e.timings, e.error_status),
            }
        )

    def run(self, stop: threading.Event) -> None:
        core = self.core
        self._do(core.report(Now.read()))  # register (not ready yet: heartbeats keep it while it warms up)
        warm = SamplingParams(max_new_tokens=2, ignore_eos=True)  # one short generation, then the matchers' warm-up
        self.engine.generate([GenerateRequest(prompt_ids=[self.engine.tokenizer.bos_token_id or 0], sampling=warm)])
        self.guides.warm_up(self.engine.runner.masks)
        self._do(core.become_ready(Now.read()))
        log.info("worker %s ready: %d pool pages", self.config.worker_id, self.engine.layout.num_pages)
        try:
            while core.going(Now.read()):
                if stop.is_set() and not core.draining:
                    self._do(core.drain(Now.read()))
                self._take(block_s=0.0 if self.engine.has_unfinished() else min(0.05, self.config.report_interval_s))
                self._do(core.expire(Now.read()))
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._do(core.idle(Now.read()))
            self._do(core.stop(Now.read()))
        except Exception as e:
            log.exception("worker %s failed", self.config.worker_id)
            self._do(core.stop(Now.read(), e))
            raise
        finally:
            self.close()

    def _take(self, block_s: float) -> None:
        """Give the core what arrived; when idle (`block_s`), first wait that long for something to."""
        if not self.io.alive:
            raise RuntimeError("the worker's I/O thread died")
        self.engine.check_ranks()  # a split model's other ranks: one that died fails the worker now, idle or not
        self.cores.use(idle=bool(block_s))  # an idle loop is not pinned: it could wait for seconds to run there
        if block_s:
            zmq.select([self._wakeup.fd], [], [], block_s)
        self._wakeup.clear()
        for source in (self.io.events, self.io.inbox):  # this thread alone takes from them
            while not source.empty():
                self._do(self.core.take(source.get_nowait(), Now.read()))
        while not self._fetches.results.empty():
            self._do(self.core.fetched(self._fetches.results.get_nowait(), Now.read()))
        for built in self.guides.take():
            self._do(self.core.built(built, Now.read()))

    def _step(self) -> None:
        started = self.io.step_started = time.monotonic()  # the heartbeats carry how long it has run
        try:
            outputs = self.engine.step()
        finally:
            self.io.step_started = None
        seconds = time.monotonic() - started
        self._step_seconds.observe(seconds)
        self.reporter.sample_step(seconds)
        self._do(self.core.deliver(outputs, Now.read()) + self.core.report(Now.read()))

    def _do(self, todo: list[effects.Effect]) -> None:
        for effect in todo:
            self._effects(effect)

    def _start(self, start: effects.Start) -> None:
        try:
            self.core.started(start.spec.request_id, self.engine.add_spec(start.spec, start.guide))
        except LoraserveError as e:
            self._do(self.core.start_failed(start.spec.request_id, e, Now.read()))

    def _report(self, report: effects.Report) -> None:
        message = self.reporter.report(report.ready, report.draining, report.waiting, report.fatal, report.finished)
        self.io.to_scheduler(message)
        self.last_report = message  # one reference swap: safe for the scrape thread

    def close(self) -> None:
        self.guides.close()
        self._fetches.close()
        self.io.close(linger_ms=200)
        self._wakeup.close()
        self.ctx.term()
        self.engine.close()
