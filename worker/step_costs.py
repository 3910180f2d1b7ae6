"""A fitted linear model of what one engine step costs, from the step's composition (torch-free).

    costs = CostModel.from_dict(json.loads(text))
    costs.step_s(step_features([(1, 100, 8, "a"), (64, 64, 0, None)]))  # chunks: (tokens, context, rank, adapter)
    costs.copy_s(rank)                                                   # one adapter into the pool
    costs.fetch_s(rank)                                                  # parse, check and pack its bytes

The model (fitted by `bench/suites/runner_profile/costs.py` on the real engine) is

    step_s = c0 + c_seq·seqs + c_tok·tokens + c_ad·adapters + c_lora·Σ tokens_i·rank_i
             + c_key·Σ_groups G·S + c_score·Σ_groups G·Q·S

where attention's two groups (decoding sequences, prefill chunks) are each padded to their longest
member: G sequences, S the longest context, Q the longest chunk (`kernels/attention_torch.py`).
The emulated runner waits what it predicts (`worker/emulated/runner.py`; the scheduling benchmark's
workers are emulated), so it lives here, where the worker can read it without bench/.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

FEATURES = ("const", "seqs", "tokens", "adapters", "token_rank", "key_slots", "score_slots")


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes, as the cost model sees it."""

    seqs: int
    tokens: int  # prefill chunk tokens + one per decoding sequence
    adapters: int  # distinct adapters
    token_rank: int  # Σ tokens_i · rank_i over sequences with an adapter
    # Attention pads each group (decoding sequences, prefill chunks) to its longest member
    # (kernels/attention_torch.py): per group, G sequences · the longest context S (keys gathered)
    # and G · the longest chunk Q · S (scores).
    key_slots: int  # Σ_groups G · S
    score_slots: int  # Σ_groups G · Q · S
    # Unpadded, as a GPU's paged attention reads and computes them (the roofline, `worker/step_roofline.py`):
    context: int = 0  # Σ context_i: the KV entries each sequence's attention reads
    attended: int = 0  # Σ over computed tokens of the keys each attends (causal): Q·s + Q(Q+1)/2 per chunk
    adapter_rank: int = 0  # Σ rank over the distinct adapters: their A/B rows read once a step

    def vector(self) -> tuple[float, ...]:
        """The features in `FEATURES` order (the constant first)."""
        return (1.0, self.seqs, self.tokens, self.adapters, self.token_rank, self.key_slots, self.score_slots)


def step_features(chunks: list[tuple[int, int, int, object]]) -> StepFeatures:
    """A step's features from its chunks: (tokens this step, context after it, rank or 0, adapter or None)."""
    groups = ([c for c in chunks if c[0] == 1], [c for c in chunks if c[0] > 1])  # decode, prefill
    key_slots = score_slots = 0
    for group in groups:
        if group:
            longest_context = max(c[1] for c in group)
            key_slots += len(group) * longest_context
            score_slots += len(group) * max(c[0] for c in group) * longest_context
    ranks = {c[3]: c[2] for c in chunks if c[3] is not None}
    return StepFeatures(
        seqs=len(chunks),
        tokens=sum(c[0] for c in chunks),
        adapters=len(ranks),
        token_rank=sum(c[0] * c[2] for c in chunks),
        key_slots=key_slots,
        score_slots=score_slots,
        context=sum(c[1] for c in chunks),
        attended=sum(c[0] * (c[1] - c[0]) + c[0] * (c[0] + 1) // 2 for c in chunks),
        adapter_rank=sum(ranks.values()),
    )


def linear_cost(coef: tuple[float, ...], features: StepFeatures) -> float:
    """Σ coef_i · feature_i, in seconds."""
    return float(sum(c * x for c, x in zip(coef, features.vector(), strict=True)))


@dataclass(frozen=True)
class CostModel:
    """A step's cost from its features, and an adapter's copy into the pool and fetch, from its rank."""

    step_coef: tuple[float, ...]  # seconds per unit of each FEATURES entry
    copy_coef: tuple[float, float]  # copy_s = a + b · rank
    fetch_coef: tuple[float, float]  # fetch_s = a + b · rank
    measured_on: dict = field(default_factory=dict)  # machine, model, threads, samples, fit quality

    def __post_init__(self) -> None:
        if len(self.step_coef) != len(FEATURES) or len(self.copy_coef) != 2 or len(self.fetch_coef) != 2:
            raise ValueError(f"a cost model has {len(FEATURES)} step coefficients and 2 per adapter cost")
        if any(not math.isfinite(c) or c < 0 for c in (*self.step_coef, *self.copy_coef, *self.fetch_coef)):
            raise ValueError("cost coefficients are finite non-negative numbers")

    def step_s(self, features: StepFeatures) -> float:
        return linear_cost(self.step_coef, features)

    def copy_s(self, rank: int) -> float:
        return self.copy_coef[0] + self.copy_coef[1] * rank

    def fetch_s(self, rank: int) -> float:
        return self.fetch_coef[0] + self.fetch_coef[1] * rank

    def as_dict(self) -> dict:
        """JSON-ready: the step coefficients keyed by feature name."""
        d = asdict(self)
        d["step_coef"] = coef_dict(self.step_coef)
        d["copy_coef"], d["fetch_coef"] = list(self.copy_coef), list(self.fetch_coef)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        """The inverse of `as_dict` (step coefficients also as a plain list); ValueError/KeyError/TypeError
        on a malformed one."""
        return cls(
            coef_tuple(d["step_coef"]),
            _pair(d["copy_coef"]),
            _pair(d["fetch_coef"]),
            dict(d.get("measured_on") or {}),
        )


def coef_dict(coef: tuple[float, ...]) -> dict[str, float]:
    return dict(zip(FEATURES, coef, strict=True))


def coef_tuple(coef: dict | list) -> tuple[float, ...]:
    """Coefficients from `coef_dict`'s form (every feature named) or a list in `FEATURES` order."""
    if isinstance(coef, dict):
        missing = [f for f in FEATURES if f not in coef]
        if missing:
            raise KeyError(f"step coefficients lack {', '.join(missing)}")
        return tuple(float(coef[f]) for f in FEATURES)
    return tuple(float(c) for c in coef)


def _pair(values: list) -> tuple[float, float]:
    a, b = values
    return float(a), float(b)
