"""The chaos benchmark's decisions, as plain data: its configuration, the requests, the disruptions.

Nothing here touches a process or a socket, so every choice is a function of the seed:

- the load is S-LoRA's synthetic trace (`bench/workloads/slora.py`) over `n_adapters` synthetic adapters,
  cv = 1 (Poisson arrivals); a seeded share of the requests sample (temperature 0.9, top-p 0.95,
  a fixed seed each), the rest are greedy. Every request ignores EOS, so it streams exactly its
  `max_new_tokens` whatever worker serves it, and its tokens can be compared with a reference run;
- disruptions come at exponential gaps of mean `interval_s`, each a kind from `signals` and a
  `pick` in [0, 1) that chooses the victim among the workers open to disruption at that moment,
  those holding requests first (`choose_victim`): which those are depends on how fast earlier
  victims came back and where the scheduler placed the load, which only the I/O loop can see.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loraserve.bench.common.preset import Preset
from loraserve.bench.workloads.slora import DEFAULT_RANKS, TraceRequest, WorkloadSpec, synthetic_trace

SIGNALS = ("kill", "stop", "term")  # SIGKILL; SIGSTOP then SIGCONT; SIGTERM (drain)
SAMPLED = {"temperature": 0.9, "top_p": 0.95}
SEED_BASE = 1000  # a sampled request's seed is SEED_BASE + its index in the trace


@dataclass(frozen=True)
class ChaosConfig(Preset):
    """The chaos run's configuration; the suite's FULL and QUICK presets are two of them."""

    duration_s: float = 180.0  # of the load; disruptions fall inside it
    workers: int = 3
    rate: float = 1.5  # requests/s, all adapters together: the stack keeps up with a worker down
    interval_s: float = 8.0  # mean seconds between disruptions
    signals: tuple[str, ...] = SIGNALS
    n_adapters: int = 100
    alpha: float = 1.0  # power-law exponent of adapter popularity
    input_len: tuple[int, int] = (8, 32)
    output_len: tuple[int, int] = (64, 192)  # max_new_tokens, generated to the end (EOS ignored)
    ranks: tuple[int, ...] = DEFAULT_RANKS
    sampled_fraction: float = 0.5  # requests that sample with a fixed seed; the rest are greedy
    seed: int = 0
    quiet_s: float = 3.0  # no disruption in the first and the last seconds of the load
    stop_s: float = 3.0  # SIGSTOP lasts this long before SIGCONT (longer than worker_timeout_s)
    down_s: float = 1.0  # a killed or drained worker stays down this long before its restart
    worker_timeout_s: float = 1.5  # the scheduler drops a silent worker after this long
    drain_timeout_s: float = 3.0  # a SIGTERMed worker's drain; its streams still running then fail over
    recover_timeout_s: float = 90.0  # a victim not serving again after this long fails the run
    stream_timeout_s: float = 180.0  # the client's deadline per stream
    max_batch_size: int = 4  # per worker: small, so placement (busiest first) spreads the load
    pool_pages: int = 1024
    vocab_size: int = 1024

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError(f"the chaos run needs >= 2 workers (one always stays up), got {self.workers}")
        if not self.signals or set(self.signals) - set(SIGNALS):
            raise ValueError(f"signals must be a non-empty subset of {SIGNALS}, got {self.signals}")
        if min(self.duration_s, self.rate, self.interval_s) <= 0:
            raise ValueError("duration_s, rate and interval_s must be > 0")
        if not 0 <= self.sampled_fraction <= 1:
            raise ValueError(f"sampled_fraction must be in [0, 1], got {self.sampled_fraction}")
        if self.stop_s <= self.worker_timeout_s:
            raise ValueError("stop_s must exceed worker_timeout_s, or a stopped worker is never dropped")


@dataclass(frozen=True)
class ChaosRequest:
    request: TraceRequest  # arrival, adapter, prompt ids, max_new_tokens, id
    seed: int | None  # None: greedy; else sampled with SAMPLED and this seed


@dataclass(frozen=True)
class Disruption:
    at_s: float  # seconds after the load starts
    kind: str  # one of SIGNALS
    pick: float  # in [0, 1): chooses among the workers open to disruption then


def chaos_requests(config: ChaosConfig) -> tuple[dict[str, int], list[ChaosRequest]]:
    """The adapters (name -> rank) and the requests, in arrival order."""
    shared = ("n_adapters", "alpha", "rate", "duration_s", "input_len", "output_len", "ranks", "vocab_size", "seed")
    trace = synthetic_trace(WorkloadSpec(cv=1.0, **{name: getattr(config, name) for name in shared}))
    sampled = np.random.default_rng([config.seed, 2]).random(len(trace.requests)) < config.sampled_fraction
    requests = [
        ChaosRequest(r, SEED_BASE + i if s else None)
        for i, (r, s) in enumerate(zip(trace.requests, sampled, strict=True))
    ]
    return trace.adapters, requests


def disruption_schedule(config: ChaosConfig) -> list[Disruption]:
    """Disruptions in [quiet_s, duration_s - quiet_s), exponential gaps of mean interval_s."""
    rng = np.random.default_rng([config.seed, 1])  # a stream of its own: the load does not shift it
    out: list[Disruption] = []
    t = config.quiet_s
    while True:
        t += float(rng.exponential(config.interval_s))
        if t >= config.duration_s - config.quiet_s:
            return out
        which, pick = rng.random(2)  # always two draws: the times do not depend on the signals chosen
        out.append(Disruption(round(t, 3), config.signals[int(which * len(config.signals))], float(pick)))


def choose_victim(pick: float, open_workers: list[str], busy: set[str]) -> str | None:
    """The worker `pick` selects among those serving and undisturbed (`open_workers`), preferring
    those holding requests (`busy`): a disruption is meant to cost streams. None when disrupting
    one would leave none serving."""
    if len(open_workers) < 2:
        return None
    ordered = sorted(w for w in open_workers if w in busy) or sorted(open_workers)
    return ordered[min(int(pick * len(ordered)), len(ordered) - 1)]
