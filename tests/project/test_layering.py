"""Layering: the roles that never run a model never load torch (2-3 s and hundreds of MB at start).

The gateway needs the model's config (context length) and the adapter store validates adapters;
both use the torch-free shared modules (`loraserve/model_config.py`, `loraserve/adapter_format.py`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    [
        "loraserve.gateway.main",
        "loraserve.adapter_store.main",
        "loraserve.model_config",
        "loraserve.adapter_format",
    ],
)
def test_module_imports_without_torch(module: str):
    code = f"import sys, {module}; loaded = sorted(m for m in ('torch', 'triton') if m in sys.modules); print(loaded)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing {module} loads {out.stdout.strip()}"


def test_the_store_validates_a_safetensors_adapter_without_torch():
    """Not only the import: a whole registration check runs on numpy alone."""
    code = r"""
import json, sys
import numpy as np
from safetensors.numpy import save
from loraserve.adapter_format import check_adapter_bytes
from loraserve.model_config import ModelConfig

model = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2})
prefix = "base_model.model.model.layers.0.self_attn.q_proj"
weights = save({f"{prefix}.lora_A.weight": np.full((2, 16), 0.1, np.float16),
                f"{prefix}.lora_B.weight": np.full((16, 2), 0.1, np.float16)})
checked = check_adapter_bytes(json.dumps({"r": 2, "target_modules": ["q_proj"]}), weights, model, 8)
assert checked.modules == ("q_proj",) and checked.layers == (0,)
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
