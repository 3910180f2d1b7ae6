"""`loraserve bench --suite chaos`: steady load on many adapters while workers are killed at random.

    loraserve bench --suite chaos --out results/chaos                  # 180 s of load, 3 workers
    loraserve bench --suite chaos --quick --out /tmp/chaos              # 40 s
    loraserve bench --suite chaos --chaos-signals kill --chaos-interval 5 --out r/

Starts a stack (adapter store, scheduler, `workers` workers, gateway) on free loopback ports and
uploads `n_adapters` synthetic adapters through the public API. Then the same requests
(`chaos_plan.chaos_requests`) are replayed twice in real time, each a `GenerateStream` call:

1. the reference: undisturbed;
2. the chaos run: meanwhile, at the seeded times of `disruption_schedule`, a worker open to
   disruption (serving and not itself recovering; one holding requests if any does) gets
   SIGKILL, SIGSTOP (SIGCONT `stop_s` later) or SIGTERM (it drains for `drain_timeout_s`, then
   exits), and a worker that exited is started again `down_s` later. One worker is never
   disrupted while it is the only one serving.

Streams on a lost worker are failed over by the gateway; every chaos stream that completes must
equal its reference token for token. The figures are in `chaos_report.summarize_chaos`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from loraserve.bench.common.engine_run import quiet
from loraserve.bench.common.results import cpu_fields, publish, write_jsonl
from loraserve.bench.common.stack_run import local_stack, upload_messages
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.suites.chaos.plan import (
    SAMPLED,
    SIGNALS,
    ChaosConfig,
    ChaosRequest,
    Disruption,
    chaos_requests,
    choose_victim,
    disruption_schedule,
)
from loraserve.bench.suites.chaos.report import (
    OK,
    AppliedDisruption,
    StreamRecord,
    chaos_targets,
    max_gap,
    print_chaos_report,
    summarize_chaos,
)
from loraserve.config_cli import setting
from loraserve.grpc_utils import internal_channel
from loraserve.launcher.local_stack import LocalStack
from loraserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

Clock = Callable[[], float]
SIGNAL = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


def run_chaos(config: ChaosConfig, model: Path) -> dict:
    """Both runs on one fresh stack; returns {"summary", "streams", "disruptions"}."""
    with local_stack(
        model,
        workers=config.workers,
        max_batch_size=config.max_batch_size,
        pool_pages=config.pool_pages,
        worker_timeout=config.worker_timeout_s,
        drain_timeout=config.drain_timeout_s,
    ) as stack:
        return asyncio.run(_run(stack, config, SyntheticAdapters(model, seed=config.seed)))


async def _run(stack: LocalStack, config: ChaosConfig, synthetic: SyntheticAdapters) -> dict:
    adapters, requests = chaos_requests(config)
    async with (
        grpc.aio.insecure_channel(stack.address) as channel,
        internal_channel(stack.ports.scheduler, stack.internal_token) as scheduler_channel,
    ):
        api = gateway_pb2_grpc.LoraServeStub(channel)
        chaos = Chaos(stack, scheduler_pb2_grpc.SchedulerStub(scheduler_channel), config)
        for name, rank in adapters.items():
            await api.UploadAdapter(upload_messages(name, *synthetic.files(name, rank)), timeout=120)
        await chaos.until_serving(config.workers, config.recover_timeout_s)
        warm = gateway_pb2.GenerateRequest(adapter=next(iter(adapters)), text="warm up", max_new_tokens=2)
        await api.Generate(warm, timeout=60)
        log.info("reference run: %d requests over %.0f s, undisturbed", len(requests), config.duration_s)
        reference = await _phase(api, requests, config, None)
        await chaos.until_serving(config.workers, config.recover_timeout_s)
        schedule = disruption_schedule(config)
        log.info("chaos run: the same requests, %d disruptions scheduled", len(schedule))
        streams = await _phase(api, requests, config, (chaos, schedule))
    return {
        "summary": summarize_chaos(reference, streams, chaos.applied),
        "streams": [
            {"run": run, **r.as_dict()}
            for run, records in (("reference", reference), ("chaos", streams))
            for r in records
        ],
        "disruptions": [asdict(d) for d in chaos.applied],
    }


async def _phase(
    api: gateway_pb2_grpc.LoraServeStub,
    requests: list[ChaosRequest],
    config: ChaosConfig,
    disrupt: tuple[Chaos, list[Disruption]] | None,
) -> list[StreamRecord]:
    """Every request opened at its arrival time (open loop), and the disruptions meanwhile."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def clock() -> float:
        return loop.time() - t0

    disruptions = asyncio.create_task(disrupt[0].run(disrupt[1], clock)) if disrupt else None
    records, tasks = [], []
    for request in requests:
        await asyncio.sleep(max(0.0, request.request.arrival_s - clock()))
        r = request.request
        record = StreamRecord(r.request_id, r.adapter, request.seed is not None, r.max_new_tokens, round(clock(), 4))
        records.append(record)
        tasks.append(asyncio.create_task(_stream(api, request, record, clock, config.stream_timeout_s)))
    await asyncio.gather(*tasks)
    if disruptions is not None:
        await disruptions  # every victim serves again before the run ends
    failed = sum(1 for r in records if r.status != OK)
    log.info("  %d streams done in %.1f s, %d failed", len(records), clock(), failed)
    return records


def _message(request: ChaosRequest) -> gateway_pb2.GenerateRequest:
    r = request.request
    sampling = common_pb2.SamplingParameters(ignore_eos=True)
    if request.seed is not None:
        sampling.temperature, sampling.top_p, sampling.seed = SAMPLED["temperature"], SAMPLED["top_p"], request.seed
    return gateway_pb2.GenerateRequest(
        adapter=r.adapter,
        token_ids=gateway_pb2.TokenIds(ids=list(r.prompt_ids)),
        max_new_tokens=r.max_new_tokens,
        sampling=sampling,
        client_request_id=r.request_id,
    )


async def _stream(
    api: gateway_pb2_grpc.LoraServeStub, request: ChaosRequest, record: StreamRecord, clock: Clock, timeout_s: float
) -> None:
    started, chunk_times = clock(), []
    try:
        async for event in api.GenerateStream(_message(request), timeout=timeout_s):
            if event.HasField("chunk"):
                if event.chunk.token_ids:
                    chunk_times.append(clock())
                    record.tokens += event.chunk.token_ids
            else:
                record.failovers, record.worker_id = event.summary.failovers, event.summary.worker_id
        record.status = OK
    except grpc.aio.AioRpcError as e:
        record.status, record.detail = e.code().name, e.details() or ""
    record.total_s = round(clock() - started, 4)
    record.ttft_s = round(chunk_times[0] - started, 4) if chunk_times else None
    gap = max_gap(started, chunk_times)
    if gap is not None:
        record.max_gap_s, record.max_gap_at_s = round(gap[0], 4), round(gap[1], 4)


class Chaos:
    """Applies disruptions to the workers and brings them back; owns which workers are recovering."""

    def __init__(self, stack: LocalStack, scheduler: scheduler_pb2_grpc.SchedulerStub, config: ChaosConfig) -> None:
        self.stack, self.scheduler, self.config = stack, scheduler, config
        self.recovering: set[str] = set()
        self.applied: list[AppliedDisruption] = []

    async def serving(self, since_s: float | None = None) -> dict[str, int]:
        """Workers ready and not draining (with a report at most `since_s` old, if given) -> the
        requests each holds."""
        state = await self.scheduler.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5)
        return {
            w.worker_id: w.running + w.waiting
            for w in state.workers
            if w.ready and not w.draining and (since_s is None or w.last_report_age_s < since_s)
        }

    async def until_serving(self, count: int, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while len(await self.serving()) < count:
                await asyncio.sleep(0.2)

    async def run(self, schedule: list[Disruption], clock: Clock) -> None:
        tasks = []
        for d in schedule:
            await asyncio.sleep(max(0.0, d.at_s - clock()))
            serving = await self.serving()
            open_workers = [w for w in serving if w not in self.recovering]
            busy = {w for w, held in serving.items() if held}
            applied = AppliedDisruption(d.at_s, d.kind, choose_victim(d.pick, open_workers, busy))
            self.applied.append(applied)
            if applied.worker is None:
                log.info("  t=%.1f s: %s skipped, fewer than two workers open to disruption", d.at_s, d.kind)
                continue
            self.recovering.add(applied.worker)
            tasks.append(asyncio.create_task(self._disrupt(applied, clock)))
        await asyncio.gather(*tasks)

    async def _disrupt(self, applied: AppliedDisruption, clock: Clock) -> None:
        name, config = applied.worker, self.config
        assert name is not None
        process = self.stack.process(name)
        applied.signalled_s = signalled = round(clock(), 4)
        process.send_signal(SIGNAL[applied.kind])
        if applied.kind == "stop":
            try:
                await asyncio.sleep(config.stop_s)
            finally:
                process.send_signal(signal.SIGCONT)
        else:
            applied.exit_code = await asyncio.to_thread(process.wait, config.drain_timeout_s + 30)
            await asyncio.sleep(config.down_s)
            self.stack.stack.restart(name)
        back = clock()
        async with asyncio.timeout(config.recover_timeout_s):
            while name not in await self.serving(since_s=clock() - back):  # a report sent since it came back
                await asyncio.sleep(0.1)
        applied.recovery_s = round(clock() - signalled, 3)
        self.recovering.discard(name)
        log.info("  t=%.1f s: %s %s, serving again after %.1f s", applied.at_s, applied.kind, name, applied.recovery_s)


# ---- the command ---------------------------------------------------------------------------------
FULL = ChaosConfig(duration_s=180.0, interval_s=10.0)
QUICK = ChaosConfig(duration_s=40.0, interval_s=5.0)


@dataclass(frozen=True)
class ChaosSettings:
    """The chaos suite's own flags (it also reads --n-adapters, --seed, --quick, --out, --model, ...)."""

    chaos_duration: float | None = setting(
        None, f"seconds of load (full: {FULL.duration_s:g}; quick: {QUICK.duration_s:g})"
    )
    chaos_workers: int = setting(3, "workers in the stack (one always stays up)")
    chaos_rate: float = setting(ChaosConfig.rate, "requests/s (Poisson arrivals)")
    chaos_interval: float | None = setting(
        None, f"mean seconds between disruptions (full: {FULL.interval_s:g}; quick: {QUICK.interval_s:g})"
    )
    chaos_signals: tuple[str, ...] = setting(
        SIGNALS,
        "disruptions to draw from: kill (SIGKILL), stop (SIGSTOP, SIGCONT later), term (SIGTERM: drain)",
        nargs="+",
        metavar="KIND",
    )
    chaos_max_batch_size: int = setting(
        ChaosConfig.max_batch_size,
        "running requests per worker: small, so the load spreads over the workers a disruption may hit",
    )
    chaos_stop: float = setting(ChaosConfig.stop_s, "seconds between SIGSTOP and SIGCONT")
    chaos_drain_timeout: float = setting(
        ChaosConfig.drain_timeout_s, "a SIGTERMed worker's drain, seconds; streams still running then fail over"
    )


SETTINGS = ChaosSettings


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    """The preset (`--quick` or the full one) with what the flags set."""
    unknown = sorted(set(args.chaos_signals) - set(SIGNALS))
    if unknown:  # checked here, not with choices=, so the LORASERVE_CHAOS_SIGNALS=kill,stop twin works too
        raise SystemExit(f"--chaos-signals: unknown {', '.join(unknown)}; choose from {', '.join(SIGNALS)}")
    return (QUICK if args.quick else FULL).but(
        duration_s=args.chaos_duration,
        workers=args.chaos_workers,
        rate=args.chaos_rate,
        interval_s=args.chaos_interval,
        signals=tuple(dict.fromkeys(args.chaos_signals)),
        n_adapters=args.n_adapters[0] if args.n_adapters else None,
        alpha=args.alpha,
        input_len=tuple(args.input_len) if args.input_len else None,
        output_len=tuple(args.output_len) if args.output_len else None,
        ranks=tuple(args.ranks),
        seed=args.seed,
        stop_s=args.chaos_stop,
        drain_timeout_s=args.chaos_drain_timeout,
        max_batch_size=args.chaos_max_batch_size,
        pool_pages=args.pool_pages,
    )


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    quiet(None)
    result = run_chaos(config, args.model)
    print_chaos_report(result["summary"], config)
    summary, disruptions = result["summary"], result["disruptions"]
    fields = {"config": asdict(config), "summary": summary, "disruptions": disruptions}
    publish(args.out, "chaos", disruptions, machine_extra=cpu_fields(), targets=chaos_targets(summary), **fields)
    if args.out:
        write_jsonl(args.out / "streams.jsonl", result["streams"])
    return 0 if summary["mismatches"] == 0 else 1
