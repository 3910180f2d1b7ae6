"""A step's time from a device's roofline: the bytes it moves over memory bandwidth, or the flops it does
over peak compute, whichever is longer, plus a fixed per-step overhead (torch-free).

    roofline = Roofline.from_dict(profile["roofline"])
    roofline.step_s(step_features(chunks))   # overhead_s + max(bytes / bandwidth, flops / peak)

bytes and flops are linear in a step's features (`worker/step_costs.py`'s `StepFeatures`, by name;
"const" is 1): `bytes_per` and `flops_per` give each feature's bytes and flops per unit. What they
hold for a model and a device is computed, not measured (`bench/suites/runner_profile/roofline.py`).
A roofline is a lower bound: real kernels reach a fraction of either peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loraserve.worker.step_costs import StepFeatures

# The features a roofline may weigh: "const" and StepFeatures' fields.
ROOFLINE_FEATURES = ("const", *StepFeatures.__dataclass_fields__)


@dataclass(frozen=True)
class Roofline:
    """overhead_s + max(Σ bytes_per[f]·f / bandwidth, Σ flops_per[f]·f / peak) for a step's features f."""

    bandwidth_bytes_s: float  # memory bandwidth, bytes/s
    peak_flops_s: float  # peak compute at the weights' dtype, flop/s
    bytes_per: dict[str, float]  # feature name -> bytes moved per unit of it
    flops_per: dict[str, float]  # feature name -> flops per unit of it
    overhead_s: float = 0.0  # a fixed cost per step
    about: dict = field(default_factory=dict)  # the device, the model, the assumptions and their sources

    def __post_init__(self) -> None:
        unknown = sorted((set(self.bytes_per) | set(self.flops_per)) - set(ROOFLINE_FEATURES))
        if unknown:
            raise ValueError(f"roofline: unknown features {', '.join(unknown)} (known: {', '.join(ROOFLINE_FEATURES)})")
        numbers = (*self.bytes_per.values(), *self.flops_per.values(), self.overhead_s)
        if any(not math.isfinite(x) or x < 0 for x in numbers):
            raise ValueError("roofline: bytes, flops and overhead are finite non-negative numbers")
        if not (self.bandwidth_bytes_s > 0 and self.peak_flops_s > 0):
            raise ValueError("roofline: bandwidth and peak compute are positive")

    def bytes(self, features: StepFeatures) -> float:
        return _weighted(self.bytes_per, features)

    def flops(self, features: StepFeatures) -> float:
        return _weighted(self.flops_per, features)

    def step_s(self, features: StepFeatures) -> float:
        """The step's time in seconds."""
        memory = self.bytes(features) / self.bandwidth_bytes_s
        compute = self.flops(features) / self.peak_flops_s
        return self.overhead_s + max(memory, compute)

    def scaled(self, scale: float) -> Roofline:
        """Every step `scale` (> 0) times as long (a slower device): both peaks divided, the overhead
        multiplied; `about["time_scale"]` records the product of every scaling."""
        check_scale(scale)
        return Roofline(
            self.bandwidth_bytes_s / scale,
            self.peak_flops_s / scale,
            dict(self.bytes_per),
            dict(self.flops_per),
            self.overhead_s * scale,
            {**self.about, "time_scale": self.about.get("time_scale", 1.0) * scale},
        )

    def as_dict(self) -> dict:
        return {
            "bandwidth_bytes_s": self.bandwidth_bytes_s,
            "peak_flops_s": self.peak_flops_s,
            "overhead_s": self.overhead_s,
            "bytes_per": dict(self.bytes_per),
            "flops_per": dict(self.flops_per),
            "about": dict(self.about),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Roofline:
        """The inverse of `as_dict`; ValueError (or KeyError) on a malformed one. An `about` written
        before `peaks_source` was named so gives it from its old key, `bandwidth_source`."""
        if not isinstance(d, dict):
            raise ValueError("roofline: not an object")
        about = d.get("about") or {}
        if not isinstance(about, dict):
            raise ValueError('roofline: "about" is not an object')
        if "bandwidth_source" in about and "peaks_source" not in about:
            about = {("peaks_source" if k == "bandwidth_source" else k): v for k, v in about.items()}
        return cls(
            _number(d["bandwidth_bytes_s"], "bandwidth_bytes_s"),
            _number(d["peak_flops_s"], "peak_flops_s"),
            _per(d["bytes_per"], "bytes_per"),
            _per(d["flops_per"], "flops_per"),
            _number(d.get("overhead_s", 0.0), "overhead_s"),
            dict(about),
        )


def check_scale(scale: float) -> None:
    """ValueError unless `scale` (a time scale: each step `scale` times as long) is finite and > 0."""
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"time scale must be a finite number > 0, got {scale!r}")


def _number(value: object, name: str) -> float:
    """`value` as a float; ValueError unless it is a JSON number (not a bool, a string, a list...)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"roofline: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _per(value: object, name: str) -> dict[str, float]:
    """`value` as {feature name: number}; ValueError unless it is an object of numbers."""
    if not isinstance(value, dict):
        raise ValueError(f"roofline: {name} must be an object of feature name -> number, got {type(value).__name__}")
    return {str(k): _number(v, f"{name}[{k!r}]") for k, v in value.items()}


def _weighted(per: dict[str, float], features: StepFeatures) -> float:
    return float(sum(w * (1.0 if name == "const" else getattr(features, name)) for name, w in per.items()))
