"""`--model`, the setting every role that reads the base model shares: by default the embedded demo model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraserve.config_cli import setting
from loraserve.demo.assets import DEMO_MODEL_DIR


@dataclass(frozen=True)
class ModelSettings:
    """`--model`: the model directory a role reads (each role's help says which of its files)."""

    model: Path = setting(DEMO_MODEL_DIR, "Hugging Face model directory (default: the embedded demo model)")
