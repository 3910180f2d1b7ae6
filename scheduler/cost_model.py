"""Predicted seconds of one worker step from its batch's composition, refit from measured steps.

    step_s = base + per_token·tokens + per_rank_token·rank_tokens + per_adapter·adapters + per_kv_page·kv_pages

    tokens        tokens the step computes: the prompts it prefills plus one per decoding request
    rank_tokens   Σ over those tokens of their adapter's rank: the LoRA shrink + expand FLOPs
    adapters      distinct adapters in the batch: one segment each (Punica SGMV), one weight gather
    kv_pages      KV pages the step's attention reads

This is the shape S-LoRA (§6) and Punica (§4) measure: a near-constant base, a term linear in the
batch's tokens, a LoRA term proportional to rank (ranks are not padded), a small per-segment cost.
The coefficients start at `StepCost` (sized for the CPU demo model) and are refit online from the
steps workers measure (`observe`): ridge-regularised least squares toward the start values, with
exponential forgetting so the fit follows the machine, clipped at zero (no term makes a step faster).
"""

from __future__ import annotations

import contextlib
from dataclasses import astuple, dataclass

import numpy as np

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError


@dataclass(frozen=True)
class BatchShape:
    """What a step's cost depends on (see the module docstring)."""

    tokens: int = 0
    rank_tokens: int = 0
    adapters: int = 0
    kv_pages: int = 0

    def features(self) -> np.ndarray:  # [5]: a constant, then the four counts
        return np.array([1.0, self.tokens, self.rank_tokens, self.adapters, self.kv_pages])


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the step-time model, in seconds per unit."""

    base_s: float = setting(
        0.02, "step-time model's starting seconds per step (refit online)", flag="--step-cost-base-s"
    )
    per_token_s: float = setting(2e-4, "... seconds per token computed", flag="--step-cost-per-token-s")
    per_rank_token_s: float = setting(2e-6, "... seconds per token x adapter rank", flag="--step-cost-per-rank-token-s")
    per_adapter_s: float = setting(2e-3, "... seconds per distinct adapter", flag="--step-cost-per-adapter-s")
    per_kv_page_s: float = setting(2e-5, "... seconds per KV page read", flag="--step-cost-per-kv-page-s")

    def __post_init__(self) -> None:
        if any(not 0 <= c < 1e3 for c in astuple(self)):
            raise InvalidConfigError(f"step cost coefficients must be in [0, 1000), got {self}")


REFIT_EVERY = 16  # new samples before `coef` fits again, once settled
SETTLED = 1024  # samples after which the fit moves slowly (forgetting 0.995 keeps about 200)
# Typical magnitudes of the features: the prior's weight is spread evenly across them.
_SCALE = np.array([1.0, 256.0, 256.0 * 16, 4.0, 256.0])


class StepCostModel:
    """`step_s(shape)` predicts; `observe(shape, seconds)` adds a measured step and refits."""

    def __init__(self, prior: StepCost | None = None, forget: float = 0.995, prior_samples: float = 0.1):
        if not 0 < forget <= 1 or prior_samples <= 0:
            raise InvalidConfigError(f"invalid cost model settings: forget={forget}, prior_samples={prior_samples}")
        self.prior = prior or StepCost()
        self.forget = forget
        self._theta0 = np.array(astuple(self.prior))
        self._ridge = np.diag(prior_samples * _SCALE**2)
        self._xtx = np.zeros((5, 5))
        self._xty = np.zeros(5)
        self._pending: list[tuple[float, ...]] = []  # samples not yet in the sums: (1, the four counts, seconds)
        self._theta = self._theta0.copy()
        self._coef = tuple(float(c) for c in self._theta)  # the same, as floats: placement asks thousands of times
        self._dirty = False
        self.samples = 0
        self._fitted_at = 0  # `samples` at the last fit

    @property
    def coefficients(self) -> StepCost:
        self._refit()
        return StepCost(*self._coef)

    def coef(self) -> tuple[float, float, float, float, float]:
        """(base, per token, per rank-token, per adapter, per KV page), seconds: what `step_s` multiplies.
        Placement asks for every decision: once the fit has `SETTLED` samples (several times what the
        forgetting keeps) it is made again only after `REFIT_EVERY` new ones (workers send one a step);
        before, after each. `coefficients` always fits."""
        if self.samples - self._fitted_at >= REFIT_EVERY or self.samples < SETTLED:
            self._refit()
        return self._coef

    def step_s(self, shape: BatchShape) -> float:
        base, token, rank_token, adapter, kv_page = self.coef()
        return (
            base
            + token * shape.tokens
            + rank_token * shape.rank_tokens
            + adapter * shape.adapters
            + kv_page * shape.kv_pages
        )

    def observe(self, shape: BatchShape, seconds: float) -> None:
        if not 0 <= seconds < 3600:
            return
        self._pending.append((1.0, shape.tokens, shape.rank_tokens, shape.adapters, shape.kv_pages, seconds))
        self.samples += 1
        self._dirty = True

    def _fold(self) -> None:
        """Add the samples observed since the last fit to the sums, each forgotten as if added one by one
        (a sample k places back weighs forget**k): workers send one a step, fits come less often."""
        if not self._pending:
            return
        data = np.array(self._pending)
        self._pending.clear()
        x, y = data[:, :5], data[:, 5]
        weighted = x * (self.forget ** np.arange(len(x) - 1, -1, -1))[:, None]
        decay = self.forget ** len(x)
        self._xtx = decay * self._xtx + weighted.T @ x
        self._xty = decay * self._xty + weighted.T @ y

    def _refit(self) -> None:
        if not self._dirty:
            return
        self._fold()
        a = self._xtx + self._ridge
        b = self._xty + self._ridge @ self._theta0
        with contextlib.suppress(np.linalg.LinAlgError):  # cannot happen with a positive ridge; keep the last fit
            self._theta = np.clip(np.linalg.solve(a, b), 0.0, None)
            self._coef = tuple(float(c) for c in self._theta)
        self._dirty = False
        self._fitted_at = self.samples
