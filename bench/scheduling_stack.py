"""A check of the scheduling simulation against the real stack, on one scenario's trace.

    python -m loraserve.bench.scheduling_stack --costs /tmp/sched/run.json --rate 20 --duration 30 --out /tmp/sched
    python -m loraserve.bench.scheduling_stack --engine --costs /tmp/sched/run.json --rate 40 --out /tmp/sched

Starts the real stack (`LocalStack`: adapter store, scheduler with `--policy`, `--workers` workers,
gateway) once per policy, uploads the trace's adapters, and replays a `heavy-tail` trace in real
time through `GenerateStream` (bench/stack_system.py's replay). The same trace goes through the
simulation with the cost model of `--costs` (a scheduling suite's run.json). Writes
`--out/validation.json`: per policy, the real and the simulated TTFT p50 / p99 and req/s.

On a 2-core machine the stack's other processes (gateway, scheduler, store, this client) take CPU
from the two workers, which the simulation does not charge: expect the real stack to be slower.

`--engine` checks the simulated worker alone instead: the real `Engine` in this process, replaying
the trace in real time (`bench/engine_system.py`, torch on one thread), against the simulation of
one worker under `fcfs` (`--out/engine_check.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from loraserve.bench import scheduling
from loraserve.bench.scheduling_sim import SimConfig
from loraserve.bench.scheduling_traces import SimTrace, heavy_tail
from loraserve.bench.stack_system import StackSystem
from loraserve.bench.synthetic_adapters import SyntheticAdapters
from loraserve.bench.systems import ReplayLimits
from loraserve.bench.workload import FIRST_TOKEN_ID, Trace, TraceRequest
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.model_config import ModelConfig

log = logging.getLogger(__name__)


def workload_trace(trace: SimTrace, vocab_size: int, seed: int) -> Trace:
    """The same requests as `bench/workload.py` traces (random prompt token ids, seeded)."""
    rng = np.random.default_rng(seed)
    requests = tuple(
        TraceRequest(
            r.arrival_s,
            r.adapter,
            tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, r.prompt_len)),
            r.output_len,
            r.request_id,
        )
        for r in trace.requests
    )
    return Trace(requests, dict(trace.adapters), {**trace.params, "duration_s": trace.duration_s})


def _summary(ttft: list[float], completed: int, makespan: float, n: int) -> dict:
    return {
        "ttft_p50_s": round(float(np.quantile(ttft, 0.5)), 5) if ttft else None,
        "ttft_p99_s": round(float(np.quantile(ttft, 0.99)), 5) if ttft else None,
        "req_per_s": round(completed / makespan, 3) if makespan > 0 else None,
        "completed": completed,
        "n_requests": n,
    }


def _simulated(sim, n: int) -> dict:
    ok = [o for o in sim.outcomes if o.status == "ok"]
    ttft = [o.ttft_s for o in sim.outcomes if o.ttft_s is not None]
    return _summary(ttft, len(ok), max((o.finished_s for o in ok), default=0.0), n)


def _measured(records) -> dict:
    done = [r for r in records if r.finished]
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    return _summary(ttft, len(done), max((r.finish_s for r in done), default=0.0), len(records))


def validate(args: argparse.Namespace) -> list[dict]:
    costs = scheduling.cost_model_from(json.loads(args.costs.read_text())["costs"])
    model = ModelConfig.from_dir(args.model)
    trace = heavy_tail(args.rate, args.duration, args.seed, n_adapters=scheduling.ADAPTERS["heavy-tail"])
    config = SimConfig(workers=args.workers, max_batch_size=args.max_batch_size, pool_pages=args.pool_pages)
    out = []
    for policy in scheduling.policies():
        sim = scheduling.simulate(trace, policy, config, costs, model, lambda r: 1.0)
        simulated = _simulated(sim, len(trace.requests))
        system = StackSystem(
            SyntheticAdapters(args.model, seed=args.seed),
            args.pool_pages,
            args.max_batch_size,
            ReplayLimits(drain_s=30.0, progress=False),
            workers=args.workers,
            policy=policy,
        )
        records = system.run(workload_trace(trace, model.vocab_size, args.seed))
        real = _measured(records)
        errors = sorted({(r.error or "").split(":")[0] for r in records if r.error})
        out.append({"policy": policy, "rate": args.rate, "real": {**real, "errors": errors}, "simulated": simulated})
        log.info("%s: real %s, simulated %s", policy, real, simulated)
    return out


def engine_check(args: argparse.Namespace) -> list[dict]:
    """The in-process engine (one worker, no services) against the simulation of one worker."""
    import torch

    from loraserve.bench.engine_system import AdapterBank, engine_variant
    from loraserve.worker.config import EngineConfig

    torch.set_num_threads(1)
    costs = scheduling.cost_model_from(json.loads(args.costs.read_text())["costs"])
    model = ModelConfig.from_dir(args.model)
    trace = heavy_tail(args.rate, args.duration, args.seed, n_adapters=scheduling.ADAPTERS["heavy-tail"])
    config = SimConfig(workers=1, max_batch_size=args.max_batch_size, pool_pages=args.pool_pages)
    sim = scheduling.simulate(trace, scheduling.BASELINE, config, costs, model, lambda r: 1.0)
    simulated = _simulated(sim, len(trace.requests))
    engine_config = EngineConfig(
        device="cpu", max_batch_size=args.max_batch_size, pool_pages=args.pool_pages, seed=args.seed
    )
    bank = AdapterBank(SyntheticAdapters(args.model, seed=args.seed))
    system = engine_variant(
        "loraserve", args.model, engine_config, bank, ReplayLimits(drain_s=30.0, progress=False), 0.5
    )
    records = system.run(workload_trace(trace, model.vocab_size, args.seed))
    real = _measured(records)
    return [{"rate": args.rate, "workers": 1, "engine": real, "simulated": simulated}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", type=Path, required=True, help="a scheduling suite's run.json (its cost model)")
    p.add_argument("--rate", type=float, default=20.0, help="requests/s of the heavy-tail trace")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--pool-pages", type=int, default=scheduling.POOL_PAGES["heavy-tail"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    p.add_argument("--engine", action="store_true", help="check one in-process engine instead of the stack")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = engine_check(args) if args.engine else validate(args)
    print(json.dumps(rows, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "engine_check.json" if args.engine else "validation.json"
        (args.out / name).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
