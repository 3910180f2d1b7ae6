"""The torch-free adapter validation (`loraserve/adapter_format.py`) and the worker's tensors from it.

numpy has no bfloat16 and casts float16 slowly, so both are widened by bit operations: checked
here against torch's own casts, for every dtype an adapter may use, from safetensors and .bin files.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save

from loraserve.adapter_format import (
    MAX_ABS_WEIGHT,
    StoredTensor,
    _values_and_peak,
    _widen_half,
    check_adapter_bytes,
    read_tensors,
)
from loraserve.errors import InvalidAdapterError
from loraserve.model_config import ModelConfig
from loraserve.worker.adapters import load_adapter_bytes

MODEL = ModelConfig.from_hf(
    {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
)
CONFIG = json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]})
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _tensors(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(MODEL.num_layers):
        for parent, module in (("self_attn", "q_proj"), ("mlp", "down_proj")):
            d_in, d_out = MODEL.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(4, d_in, generator=generator) * 0.1).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, 4, generator=generator) * 0.1).to(dtype)
    return tensors


def _bin(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def test_every_finite_half_widens_exactly():
    bits = np.arange(1 << 16, dtype=np.uint16)
    halves = bits.view(np.float16)
    finite = np.isfinite(halves)
    wide = _widen_half(halves)
    expected = halves.astype(np.float32)
    assert np.array_equal(wide[finite], expected[finite])
    assert np.array_equal(np.signbit(wide[finite]), np.signbit(expected[finite]))  # -0.0 stays -0.0
    assert (np.abs(wide[~finite]) > 65504).all()  # NaN and inf land above every finite half


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_values_and_peak_match_torch(dtype: torch.dtype, fmt: str):
    tensors = _tensors(dtype)
    raw = save(tensors) if fmt == "safetensors" else _bin(tensors)
    for name, stored in read_tensors(raw, fmt).items():
        values, peak = _values_and_peak(stored)
        reference = tensors[name].double().numpy()
        assert np.array_equal(values.astype(np.float64), reference), name
        assert peak == np.abs(reference).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_the_workers_tensors_are_the_files_tensors(dtype: torch.dtype, fmt: str):
    """Store and worker accept the same adapter; the worker's tensors keep dtype and every bit."""
    tensors = _tensors(dtype)
    raw = save(tensors) if fmt == "safetensors" else _bin(tensors)
    checked = check_adapter_bytes(CONFIG, raw, MODEL, max_rank=8, weights_format=fmt)
    adapter = load_adapter_bytes(CONFIG, raw, MODEL, max_rank=8, weights_format=fmt)
    assert checked.modules == adapter.modules == ("q_proj", "down_proj")
    assert checked.layers == adapter.layers == (0, 1)
    assert adapter.rank == 4 and adapter.scale == checked.config.scale == 2.0
    for (layer, module), (a, b) in adapter.weights.items():
        parent = "self_attn" if module == "q_proj" else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, tensors[f"{prefix}.lora_A.weight"])
        assert torch.equal(b, tensors[f"{prefix}.lora_B.weight"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_are_refused_in_every_dtype(dtype: torch.dtype, bad: float):
    tensors = _tensors(dtype)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    tensors[name][5, 2] = bad
    with pytest.raises(InvalidAdapterError, match="layer 1 down_proj: lora_B contains NaN or infinite values"):
        check_adapter_bytes(CONFIG, save(tensors), MODEL, max_rank=8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_too_large_are_refused_in_every_dtype(dtype: torch.dtype):
    tensors = _tensors(dtype)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][1, 3] = -2 * MAX_ABS_WEIGHT
    with pytest.raises(InvalidAdapterError, match="layer 0 q_proj: lora_A holds a weight of magnitude 2e\\+03"):
        check_adapter_bytes(CONFIG, save(tensors), MODEL, max_rank=8)


@pytest.mark.parametrize(
    ("dtype", "shown"), [(torch.int32, "I32"), (torch.float8_e5m2, "F8_E5M2"), (torch.bool, "BOOL")]
)
def test_other_dtypes_are_refused_by_name(dtype: torch.dtype, shown: str):
    tensors = {name: t.to(dtype) for name, t in _tensors(torch.float32).items()}
    with pytest.raises(InvalidAdapterError, match=f"lora_A has dtype {shown}; expected a floating-point type"):
        check_adapter_bytes(CONFIG, save(tensors), MODEL, max_rank=8)
    with pytest.raises(InvalidAdapterError, match="expected a floating-point type"):
        check_adapter_bytes(CONFIG, _bin(tensors), MODEL, max_rank=8, weights_format="bin")


def test_stored_tensors_are_writable_views_so_the_worker_copies_nothing():
    raw = save(_tensors(torch.bfloat16))
    stored = next(iter(read_tensors(raw, "safetensors").values()))
    assert isinstance(stored, StoredTensor) and stored.data.flags.writeable and stored.dtype == "BF16"
