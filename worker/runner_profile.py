"""The emulated runner's profile: what a step costs on the real engine, for one model, on one machine.

`loraserve bench --suite runner-profile --out DIR` writes it (DIR/runner_profile.json, see
`bench/suites/runner_profile/suite.py`); `loraserve worker --runner emulated --runner-profile FILE` reads it.
Torch-free JSON:

    {"format": "loraserve-runner-profile", "version": 1,
     "model": {"model_type": "llama", "vocab_size": 1024, ...},  # the shape it was measured on
     "runner_coef": {"const": ..., "seqs": ..., ...},            # the runner's part of a step, seconds
     "costs": {...},       # CostModel.as_dict(): the whole step, adapter copy/fetch per rank, machine, fit
     "fidelity": {...}}    # emulated against real step times on the calibration workload

`runner_coef` is the forward pass and sampling alone (`ModelRunner.execute`): what the emulated runner
replaces; the engine's own work around it (scheduling, the pool, the update) still runs for real.
`costs` is the whole step, the form the scheduling benchmark reads (`bench --suite scheduling
--sched-costs FILE` takes a profile too).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.errors import InvalidConfigError
from loraserve.model_config import ModelConfig
from loraserve.worker.step_costs import CostModel, StepFeatures, coef_dict, coef_tuple, linear_cost

FORMAT = "loraserve-runner-profile"
VERSION = 1
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
    fidelity: dict = field(default_factory=dict)  # emulated vs real step times on the calibration workload

    def __post_init__(self) -> None:
        if any(not math.isfinite(c) or c < 0 for c in self.runner_coef):
            raise ValueError("runner coefficients are finite non-negative numbers")
        if len(self.runner_coef) != len(self.costs.step_coef):
            raise ValueError(f"{len(self.costs.step_coef)} runner coefficients expected, got {len(self.runner_coef)}")

    def runner_s(self, features: StepFeatures) -> float:
        """What the real runner takes for a step of these features, in seconds."""
        return linear_cost(self.runner_coef, features)

    def check_model(self, model: ModelConfig, source: str) -> None:
        """InvalidConfigError unless the profile was measured on a model of `model`'s shape."""
        shape = model_shape(model)
        wrong = [f"{k}: profile {self.model.get(k)!r}, model {v!r}" for k, v in shape.items() if self.model.get(k) != v]
        if wrong:
            raise InvalidConfigError(
                f"runner profile {source} was measured on a different model ({'; '.join(wrong)}); {HOW_TO_WRITE} "
                "for this model"
            )

    def as_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": dict(self.model),
            "runner_coef": coef_dict(self.runner_coef),
            "costs": self.costs.as_dict(),
            "fidelity": dict(self.fidelity),
        }

    @classmethod
    def from_dict(cls, d: dict) -> RunnerProfile:
        """The inverse of `as_dict`; ValueError (or KeyError/TypeError) when `d` is not one."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f'its "format" is not {FORMAT!r}')
        if d.get("version") != VERSION:
            raise ValueError(f"version {d.get('version')!r} (this loraserve reads version {VERSION})")
        if not isinstance(d.get("model"), dict):
            raise ValueError('"model" is not an object')
        costs = CostModel.from_dict(d["costs"])
        return cls(dict(d["model"]), coef_tuple(d["runner_coef"]), costs, dict(d.get("fidelity") or {}))

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
