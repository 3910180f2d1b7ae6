"""Synthetic request traces: S-LoRA's Gamma-process workload and Punica's popularity cases.

S-LoRA (§7.2). n adapters, ranks assigned round-robin from a list. Adapter i receives requests as
a Gamma renewal process with mean rate λ_i and coefficient of variation cv:

    share_i = (i + 1)^-α / Σ_j (j + 1)^-α          λ_i = R · share_i
    gaps ~ Gamma(shape k = 1 / cv², scale θ = 1 / (λ_i · k))     (mean 1/λ_i, std cv/λ_i)

over a duration D (arrivals in [0, D)). Every request's prompt length is uniform in [Il, Iu] and
its output length (max_new_tokens, generated to the end: EOS is ignored) uniform in [Ol, Ou].

Punica (§7, text generation). `num_requests` requests, one Gamma process of rate R for all of
them, adapters assigned by popularity: distinct (each request its own adapter), uniform
(ceil(sqrt(N)) adapters, equally popular), zipf (Zipf-1.5 over N adapters), identical (one).

Prompts are token ids drawn uniformly from the vocabulary minus the special ids; everything is a
function of the seed (numpy's Generator). A trace is saved as JSON lines: a header line describing
the adapters, then one request per line, so it can be replayed exactly by every system.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loraserve.bench.common.kernel_cases import POPULARITIES, assign_adapters

DEFAULT_RANKS = (64, 32, 16, 8)  # S-LoRA's setting S2
FIRST_TOKEN_ID = 3  # ids 0, 1, 2 are <unk>, <s>, </s> in the demo tokenizer


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the trace starts
    adapter: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    request_id: str

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival, and every adapter that exists (name -> rank), used or not."""

    requests: tuple[TraceRequest, ...]
    adapters: dict[str, int]
    params: dict = field(default_factory=dict)  # how it was generated (recorded with the results)

    @property
    def duration_s(self) -> float:
        return float(self.params.get("duration_s") or (self.requests[-1].arrival_s if self.requests else 0.0))

    def used_adapters(self) -> dict[str, int]:
        used = dict.fromkeys(r.adapter for r in self.requests)
        return {name: self.adapters[name] for name in used}


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of S-LoRA's synthetic trace (Table 2 names them n, α, R, cv, [Il, Iu], [Ol, Ou])."""

    n_adapters: int = 100
    alpha: float = 1.0
    rate: float = 2.0  # R: requests per second, all adapters together
    cv: float = 1.0
    duration_s: float = 60.0
    input_len: tuple[int, int] = (8, 64)
    output_len: tuple[int, int] = (8, 64)
    ranks: tuple[int, ...] = DEFAULT_RANKS
    vocab_size: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_adapters < 1:
            raise ValueError(f"n_adapters must be >= 1, got {self.n_adapters}")
        if self.rate <= 0 or self.cv <= 0 or self.duration_s <= 0:
            raise ValueError("rate, cv and duration_s must be > 0")
        for name in ("input_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be [low, high] with 1 <= low <= high, got {[low, high]}")
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"ranks must be positive, got {self.ranks}")


def adapter_name(i: int) -> str:
    return f"adapter-{i:04d}"


def round_robin_ranks(n: int, ranks: Iterable[int]) -> dict[str, int]:
    ranks = tuple(ranks)
    return {adapter_name(i): ranks[i % len(ranks)] for i in range(n)}


def power_law_shares(n: int, alpha: float) -> np.ndarray:
    """share_i ∝ (i + 1)^-alpha, normalized to sum to 1."""
    weights = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return weights / weights.sum()


def gamma_arrivals(rng: np.random.Generator, rate: float, cv: float, duration_s: float) -> np.ndarray:
    """Arrival times in [0, duration) of a Gamma renewal process of mean rate `rate` and CV `cv`."""
    shape = 1.0 / cv**2
    scale = 1.0 / (rate * shape)
    expected = rate * duration_s
    chunk = max(8, math.ceil(expected + 6 * cv * math.sqrt(expected) + 8))
    times = np.cumsum(rng.gamma(shape, scale, size=chunk))
    while times[-1] < duration_s:  # rare: draw more gaps until the process passes the end
        times = np.concatenate([times, times[-1] + np.cumsum(rng.gamma(shape, scale, size=chunk))])
    return times[times < duration_s]


def _prompt(rng: np.random.Generator, low: int, high: int, vocab_size: int) -> tuple[int, ...]:
    length = int(rng.integers(low, high + 1))
    return tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, size=length))


def _finish(
    rng: np.random.Generator, arrivals: list[tuple[float, str]], spec_lens: tuple, vocab: int
) -> tuple[TraceRequest, ...]:
    """Sort arrivals, then draw each request's prompt and output length in arrival order."""
    (il, iu), (ol, ou) = spec_lens
    arrivals.sort()
    return tuple(
        TraceRequest(
            arrival_s=round(float(t), 6),
            adapter=name,
            prompt_ids=_prompt(rng, il, iu, vocab),
            max_new_tokens=int(rng.integers(ol, ou + 1)),
            request_id=f"req-{k:06d}",
        )
        for k, (t, name) in enumerate(arrivals)
    )


def synthetic_trace(spec: WorkloadSpec) -> Trace:
    """S-LoRA's workload: per-adapter Gamma processes with power-law mean rates."""
    rng = np.random.default_rng(spec.seed)
    adapters = round_robin_ranks(spec.n_adapters, spec.ranks)
    rates = spec.rate * power_law_shares(spec.n_adapters, spec.alpha)
    arrivals: list[tuple[float, str]] = []
    for name, rate in zip(adapters, rates, strict=True):
        arrivals += [(float(t), name) for t in gamma_arrivals(rng, rate, spec.cv, spec.duration_s)]
    requests = _finish(rng, arrivals, (spec.input_len, spec.output_len), spec.vocab_size)
    params = {"kind": "synthetic", **asdict(spec)}
    return Trace(requests, adapters, params)


def popularity_trace(
    popularity: str,
    num_requests: int,
    rate: float = 2.0,
    cv: float = 1.0,
    input_len: tuple[int, int] = (8, 64),
    output_len: tuple[int, int] = (8, 64),
    ranks: tuple[int, ...] = DEFAULT_RANKS,
    vocab_size: int = 1024,
    seed: int = 0,
) -> Trace:
    """Punica's popularity cases: `num_requests` arrivals of one Gamma process of rate `rate`."""
    if popularity not in POPULARITIES:
        raise ValueError(f"unknown popularity {popularity!r}; choose one of {', '.join(POPULARITIES)}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    times = np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=num_requests)) if num_requests else []
    which = assign_adapters(popularity, num_requests, seed)
    n_adapters = {"identical": 1, "uniform": math.ceil(math.sqrt(max(1, num_requests)))}.get(popularity, num_requests)
    adapters = round_robin_ranks(max(1, n_adapters), ranks)
    arrivals = [(float(t), adapter_name(a)) for t, a in zip(times, which, strict=True)]
    requests = _finish(rng, arrivals, (input_len, output_len), vocab_size)
    duration = float(times[-1]) if num_requests else 0.0
    params = {"kind": "popularity", "popularity": popularity, "num_requests": num_requests, "n_adapters": len(adapters)}
    params |= {"rate": rate, "cv": cv, "input_len": list(input_len), "output_len": list(output_len)}
    params |= {"ranks": list(ranks), "vocab_size": vocab_size, "seed": seed, "duration_s": duration}
    return Trace(requests, adapters, params)


# ---- JSON lines ---------------------------------------------------------------------------------
def save_trace(trace: Trace, path: str | Path) -> Path:
    """Line 1: {"trace": params, "adapters": {name: rank}}; then one request per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"trace": trace.params, "adapters": trace.adapters}) + "\n")
        for r in trace.requests:
            line = {
                "arrival_s": r.arrival_s,
                "adapter": r.adapter,
                "rank": trace.adapters[r.adapter],
                "prompt_len": r.prompt_len,
                "prompt_ids": list(r.prompt_ids),
                "max_new_tokens": r.max_new_tokens,
                "request_id": r.request_id,
            }
            f.write(json.dumps(line) + "\n")
    return path


def load_trace(path: str | Path, vocab_size: int = 1024, seed: int = 0) -> Trace:
    """Read a trace written by `save_trace`, or any JSON-lines file of requests.

    A request line needs arrival_s, adapter, max_new_tokens and prompt_ids or prompt_len (prompt ids
    are then drawn from `seed`); rank defaults to 16 when neither the line nor a header gives it.
    """
    rng = np.random.default_rng(seed)
    params: dict = {}
    adapters: dict[str, int] = {}
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "trace" in row:
            params, adapters = dict(row["trace"]), {str(k): int(v) for k, v in row.get("adapters", {}).items()}
            continue
        try:
            if "prompt_ids" in row:
                prompt = tuple(int(t) for t in row["prompt_ids"])
            else:
                prompt = _prompt(rng, int(row["prompt_len"]), int(row["prompt_len"]), vocab_size)
            request = TraceRequest(
                arrival_s=float(row["arrival_s"]),
                adapter=str(row["adapter"]),
                prompt_ids=prompt,
                max_new_tokens=int(row["max_new_tokens"]),
                request_id=str(row.get("request_id", f"req-{len(requests):06d}")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{number}: not a trace request ({e!r})") from None
        adapters.setdefault(request.adapter, int(row.get("rank", 16)))
        requests.append(request)
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(tuple(requests), adapters, params)
