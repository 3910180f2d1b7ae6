"""The emulated runner's profile: what a step of the runner costs, for one model, on one device.

Two kinds, one format. A *measured* profile: `loraserve bench --suite runner-profile --out DIR` times
the real engine on this machine and fits a linear model (DIR/runner_profile.json, see
`bench/suites/runner_profile/suite.py`). A *roofline* profile: `... --roofline h100-7b --out DIR`
computes each step's time from a GPU's spec-sheet peaks for a model's shapes, measuring nothing
(`bench/suites/runner_profile/roofline.py`). `loraserve worker --runner emulated --runner-profile FILE`
reads either. Torch-free JSON:

    {"format": "loraserve-runner-profile", "version": 2,          # 1 when it has no roofline
     "model": {"model_type": "llama", "vocab_size": 1024, ...},  # the shape it was measured (computed) on
     "runner_coef": {"const": ..., "seqs": ..., ...},            # the runner's part of a step, seconds
     "roofline": {...},    # optional (version 2): Roofline.as_dict(), added to runner_coef's time
     "costs": {...},       # CostModel.as_dict(): the whole step, adapter copy/fetch per rank, machine, fit
     "fidelity": {...}}    # emulated against real step times, in and out of sample

`runner_coef` (and the roofline) is the forward pass and sampling alone (`ModelRunner.execute`): what
the emulated runner replaces; the engine's own work around it (scheduling, the pool, the update) still
runs for real. `costs` is the whole step as measured (a roofline profile's are zeros: not modelled).
A profile without a roofline is written as version 1, so readers of version 1 read it; version 1
files still load. A measured profile is refused for a model of another shape;
a roofline profile is for any model: its times are those of the shape it names, whatever model the
worker serves (the model gives only the tokens).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.errors import InvalidConfigError
from loraserve.model_config import ModelConfig
from loraserve.worker.step_costs import CostModel, StepFeatures, coef_dict, coef_tuple, linear_cost
from loraserve.worker.step_roofline import Roofline, check_scale

FORMAT = "loraserve-runner-profile"
VERSION = 2  # the newest version written: a profile with a roofline (one without is written as version 1)
READS = (1, 2)  # version 1: no roofline
# The model's shape that sets step costs and token ids: a profile is refused for a model that differs.
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
)
HOW_TO_WRITE = (
    "write one with `loraserve bench --suite runner-profile --model MODEL_DIR --out DIR` (DIR/runner_profile.json)"
)


def model_shape(model: ModelConfig) -> dict:
    """The fields of `model` a profile records and checks (`SHAPE_FIELDS`)."""
    return {name: getattr(model, name) for name in SHAPE_FIELDS}


@dataclass(frozen=True)
class RunnerProfile:
    model: dict  # model_shape() of the model it was measured on
    runner_coef: tuple[float, ...]  # the runner's part of a step, seconds per unit of each step_costs.FEATURES
    costs: CostModel  # the whole step and adapter loads; measured_on: the machine, the fit's error
    fidelity: dict = field(default_factory=dict)  # emulated vs real step times, in and out of sample
    roofline: Roofline | None = None  # a computed profile's step time, added to runner_coef's

    def __post_init__(self) -> None:
        if any(not math.isfinite(c) or c < 0 for c in self.runner_coef):
            raise ValueError("runner coefficients are finite non-negative numbers")
        if len(self.runner_coef) != len(self.costs.step_coef):
            raise ValueError(f"{len(self.costs.step_coef)} runner coefficients expected, got {len(self.runner_coef)}")

    def runner_s(self, features: StepFeatures) -> float:
        """What the real runner takes for a step of these features, in seconds."""
        linear = linear_cost(self.runner_coef, features)
        return linear if self.roofline is None else linear + self.roofline.step_s(features)

    def scaled(self, scale: float) -> RunnerProfile:
        """This profile with every step taking `scale` (> 0) times as long (the runner's part, the
        roofline's and the whole step's costs; adapter copies and fetches unchanged). `fidelity["time_scale"]`
        (like the roofline's `about["time_scale"]`) records the product of every scaling."""
        check_scale(scale)
        costs = CostModel(
            tuple(c * scale for c in self.costs.step_coef),
            self.costs.copy_coef,
            self.costs.fetch_coef,
            self.costs.measured_on,
        )
        return RunnerProfile(
            self.model,
            tuple(c * scale for c in self.runner_coef),
            costs,
            {**self.fidelity, "time_scale": self.fidelity.get("time_scale", 1.0) * scale},
            None if self.roofline is None else self.roofline.scaled(scale),
        )

    def check_model(self, model: ModelConfig, source: str) -> None:
        """InvalidConfigError unless the profile was measured on a model of `model`'s shape (a roofline
        profile fits any model: see the module docstring)."""
        if self.roofline is not None:
            return
        shape = model_shape(model)
        wrong = [f"{k}: profile {self.model.get(k)!r}, model {v!r}" for k, v in shape.items() if self.model.get(k) != v]
        if wrong:
            raise InvalidConfigError(
                f"runner profile {source} was measured on a different model ({'; '.join(wrong)}); {HOW_TO_WRITE} "
                "for this model"
            )

    def as_dict(self) -> dict:
        roofline = {} if self.roofline is None else {"roofline": self.roofline.as_dict()}
        return {
            "format": FORMAT,
            "version": 1 if self.roofline is None else VERSION,
            "model": dict(self.model),
            "runner_coef": coef_dict(self.runner_coef),
            **roofline,
            "costs": self.costs.as_dict(),
            "fidelity": dict(self.fidelity),
        }

    @classmethod
    def from_dict(cls, d: dict) -> RunnerProfile:
        """The inverse of `as_dict`; ValueError (or KeyError/TypeError) when `d` is not one."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f'its "format" is not {FORMAT!r}')
        if d.get("version") not in READS:
            raise ValueError(f"version {d.get('version')!r} (this loraserve reads versions {READS[0]}–{READS[-1]})")
        if not isinstance(d.get("model"), dict):
            raise ValueError('"model" is not an object')
        costs = CostModel.from_dict(d["costs"])
        roofline = Roofline.from_dict(d["roofline"]) if d.get("roofline") is not None else None
        return cls(dict(d["model"]), coef_tuple(d["runner_coef"]), costs, dict(d.get("fidelity") or {}), roofline)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=1) + "\n")


def load_profile(path: Path, model: ModelConfig) -> RunnerProfile:
    """The profile at `path`, checked against `model`; InvalidConfigError saying what to do otherwise."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise InvalidConfigError(f"runner profile {path} does not exist: {HOW_TO_WRITE}") from None
    except OSError as e:
        raise InvalidConfigError(f"runner profile {path} cannot be read ({e.strerror}): {HOW_TO_WRITE}") from None
    try:
        profile = RunnerProfile.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise InvalidConfigError(
            f"runner profile {path} is not a valid loraserve runner profile ({type(e).__name__}: {e}); {HOW_TO_WRITE}"
        ) from None
    profile.check_model(model, str(path))
    return profile
