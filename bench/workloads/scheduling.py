"""Seeded request traces for the scheduling benchmark: heavy-tailed lengths, Zipf adapters, tenants, conversations.

    heavy_tail(rate, duration_s, seed)          short and long requests mixed, Zipf adapters of mixed ranks
    flood(victim_rate, flooder_rate, ...)       two tenants, each on its own adapters
    popularity(rate, duration_s, seed, n)       Zipf over many adapters (more than a worker's pool holds)
    conversations(rate, duration_s, seed, n)    multi-turn chats: a follow-up turn reuses its adapter after a pause

Arrivals are Poisson. Adapter i of n is drawn with probability ∝ (i + 1)^-alpha, and ranks go round
robin over `RANKS` in popularity order, so every rank has popular and rare adapters. Lengths:

- heavy-tail: `long_share` of the requests are long (prompt 192–384 tokens, output 48–128), the rest
  short (prompt 8–48, output a geometric tail of mean 24 capped at 96);
- flood and popularity: prompt 16–96, output 16–64, uniform;
- conversations: conversations start Poisson at `rate / MEAN_TURNS`; each has 1 + geometric turns
  (mean `MEAN_TURNS`) on one adapter. Turn 1's prompt is 32–96 tokens; a follow-up's prompt is the
  previous turn's prompt plus its output plus a new message of 16–48 tokens (the same token stream:
  its prefix is the earlier turn's), output 16–48; a conversation ends before a turn would pass
  `MAX_CONTEXT` tokens. A follow-up is sent `think_s` (exponential, mean `THINK_S`, at least
  `MIN_THINK_S`) after the previous turn's last token: its arrival time in the trace is nominal; the
  replay sends it when its predecessor has finished (`SchedRequest.follows`).

Prompt + output stays within the demo model's 512 positions. Everything is a function of the seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from loraserve.bench.workloads.slora import power_law_shares

RANKS = (8, 16, 32, 64)
MEAN_TURNS = 5.0  # conversations: turns per conversation, on average (before the context cap)
THINK_S = 2.0  # conversations: mean think time between a reply's end and the next turn
MIN_THINK_S = 0.5
MAX_CONTEXT = 480  # conversations: prompt + output of a turn stays within this


@dataclass(frozen=True)
class SchedRequest:
    request_id: str
    arrival_s: float  # nominal for a follow-up turn (see `follows`)
    adapter: str | None
    prompt_len: int
    output_len: int
    tenant: str = ""
    size: str = "short"  # the request's size class: its SLO is set per class
    follows: str | None = None  # a follow-up turn: sent `think_s` after this request ends, not at arrival_s
    think_s: float = 0.0
    stream: str = ""  # requests of one stream (a conversation) share their prompt's leading tokens


@dataclass(frozen=True)
class SchedTrace:
    name: str
    requests: tuple[SchedRequest, ...]  # sorted by arrival
    adapters: dict[str, int]  # name -> rank, every adapter that may be asked for
    params: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return float(self.params.get("duration_s", self.requests[-1].arrival_s if self.requests else 0.0))

    def only(self, tenant: str) -> SchedTrace:
        """The same trace with only `tenant`'s requests (the calm run of the flood scenario)."""
        kept = tuple(r for r in self.requests if r.tenant == tenant)
        return replace(self, requests=kept, params={**self.params, "only_tenant": tenant})


def zipf_adapters(prefix: str, n: int, ranks: tuple[int, ...] = RANKS) -> dict[str, int]:
    return {f"{prefix}{i:04d}": ranks[i % len(ranks)] for i in range(n)}


def _arrivals(rng: np.random.Generator, rate: float, duration_s: float, names: list[str], alpha: float) -> list:
    """(time, adapter) of Poisson arrivals at `rate` over `duration_s`, in order, adapters drawn by Zipf(alpha)."""
    times = np.sort(rng.uniform(0.0, duration_s, size=rng.poisson(rate * duration_s)))
    picks = rng.choice(len(names), size=len(times), p=power_law_shares(len(names), alpha))
    return [(float(t), names[i]) for t, i in zip(times, picks, strict=True)]


def heavy_tail(
    rate: float, duration_s: float, seed: int, n_adapters: int = 64, alpha: float = 1.0, long_share: float = 0.1
) -> SchedTrace:
    rng = np.random.default_rng([seed, 1])
    adapters = zipf_adapters("ht-", n_adapters)
    requests = []
    for i, (t, name) in enumerate(_arrivals(rng, rate, duration_s, list(adapters), alpha)):
        if rng.random() < long_share:
            size, prompt, output = "long", int(rng.integers(192, 385)), int(rng.integers(48, 129))
        else:
            size, prompt, output = "short", int(rng.integers(8, 49)), min(96, int(rng.geometric(1 / 24)))
        requests.append(SchedRequest(f"ht-{i}", t, name, prompt, output, size=size))
    params = {"rate": rate, "duration_s": duration_s, "seed": seed, "n_adapters": n_adapters, "alpha": alpha}
    return SchedTrace("heavy-tail", tuple(requests), adapters, {**params, "long_share": long_share})


def flood(victim_rate: float, flooder_rate: float, duration_s: float, seed: int, n_adapters: int = 16) -> SchedTrace:
    """Tenants `victim` and `flooder`, each with `n_adapters` adapters of its own (Zipf α = 1)."""
    rng = np.random.default_rng([seed, 2])
    requests = []
    adapters: dict[str, int] = {}
    for tenant, rate in (("victim", victim_rate), ("flooder", flooder_rate)):
        own = zipf_adapters(f"{tenant}-", n_adapters)
        adapters |= own
        for i, (t, name) in enumerate(_arrivals(rng, rate, duration_s, list(own), 1.0)):
            prompt, output = int(rng.integers(16, 97)), int(rng.integers(16, 65))
            requests.append(SchedRequest(f"{tenant}-{i}", t, name, prompt, output, tenant=tenant))
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    params = {"victim_rate": victim_rate, "flooder_rate": flooder_rate, "duration_s": duration_s, "seed": seed}
    return SchedTrace("flood", tuple(requests), adapters, params)


def popularity(rate: float, duration_s: float, seed: int, n_adapters: int = 1000, alpha: float = 1.0) -> SchedTrace:
    rng = np.random.default_rng([seed, 3])
    adapters = zipf_adapters("pop-", n_adapters)
    requests = [
        SchedRequest(f"pop-{i}", t, name, int(rng.integers(16, 97)), int(rng.integers(16, 65)))
        for i, (t, name) in enumerate(_arrivals(rng, rate, duration_s, list(adapters), alpha))
    ]
    params = {"rate": rate, "duration_s": duration_s, "seed": seed, "n_adapters": n_adapters, "alpha": alpha}
    return SchedTrace("popularity", tuple(requests), adapters, params)


def conversations(rate: float, duration_s: float, seed: int, n_adapters: int = 1000, alpha: float = 1.0) -> SchedTrace:
    """Multi-turn conversations at about `rate` requests/s in all (see the module docstring)."""
    rng = np.random.default_rng([seed, 4])
    adapters = zipf_adapters("pop-", n_adapters)  # the popularity scenario's adapters
    starts = _arrivals(rng, rate / MEAN_TURNS, duration_s, list(adapters), alpha)
    requests = []
    for c, (start, name) in enumerate(starts):
        turns = int(rng.geometric(1 / MEAN_TURNS))
        prompt, output = int(rng.integers(32, 97)), int(rng.integers(16, 49))
        previous, at = None, start
        for turn in range(turns):
            if prompt + output > MAX_CONTEXT:
                break
            think = max(MIN_THINK_S, float(rng.exponential(THINK_S))) if previous else 0.0
            at += think
            rid = f"conv-{c}-{turn}"
            requests.append(
                SchedRequest(rid, at, name, prompt, output, follows=previous, think_s=think, stream=f"conv-{c}")
            )
            at += 0.05 * output  # nominal: about one step per output token
            previous = rid
            prompt, output = prompt + output + int(rng.integers(16, 49)), int(rng.integers(16, 49))
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    params = {"rate": rate, "duration_s": duration_s, "seed": seed, "n_adapters": n_adapters, "alpha": alpha}
    params |= {"mean_turns": MEAN_TURNS, "think_s": THINK_S, "conversations": len(starts)}
    return SchedTrace("conversations", tuple(requests), adapters, params)


def burst(trace: SchedTrace, n: int) -> SchedTrace:
    """The first `n` requests of `trace`, all arriving at 0, none waiting on another: a saturating load
    to measure capacity."""
    kept = tuple(replace(r, arrival_s=0.0, follows=None, think_s=0.0) for r in trace.requests[:n])
    return replace(trace, requests=kept, params={**trace.params, "burst": n, "duration_s": 0.0})
