"""A PEFT LoRA adapter's two files, read and validated against the base model (torch-free).

An adapter is `adapter_config.json` + `adapter_model.safetensors` (or `adapter_model.bin`, read
with `torch.load(weights_only=True)`; torch is imported for that format only). The adapter store
validates every registration with `check_adapter_bytes`, and the worker every adapter it loads
(`worker/adapters.py` turns the result into torch tensors), so both refuse the same files with the
same `InvalidAdapterError`, whose message names the file, field or tensor at fault.

The bytes are untrusted, so no input may cost more than its size, and weights too large to be meant
are refused: every lora_A / lora_B entry finite and at most MAX_ABS_WEIGHT in magnitude, and per
projection ‖scale·B·A‖_F at most MAX_UPDATE_NORM (docs/architecture.md, "What is validated, and
the limits").
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import safetensors

from loraserve.adapter_config import CONFIG_FILE, PARENT, LoraConfig, parse_lora_config, show
from loraserve.errors import InvalidAdapterError
from loraserve.model_config import LORA_MODULES, ModelConfig

SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
WEIGHTS_FILES = {SAFETENSORS_FILE: "safetensors", BIN_FILE: "bin"}  # file name -> weights format

# Trained LoRA weights stay well below 1 in magnitude (PEFT starts A within ±1/sqrt(d_in) and B at
# 0), and the update scale·B·A is of the order of the base projection it adapts (Frobenius norm
# ~10-100 at 7B). These bounds sit orders of magnitude above that: what exceeds them cannot be
# meant, and would overflow activations (float16 tops out at 65504) into NaN for its requests.
MAX_ABS_WEIGHT = 1e3
MAX_UPDATE_NORM = 1e4

# The weight dtypes an adapter may use, by safetensors code -> (name, numpy type of the stored
# values). numpy has no bfloat16: its values are kept as their bits (uint16) and widened exactly.
WEIGHT_DTYPES = {
    "F16": ("float16", np.dtype("<f2")),
    "BF16": ("bfloat16", np.dtype("<u2")),
    "F32": ("float32", np.dtype("<f4")),
    "F64": ("float64", np.dtype("<f8")),
}
_HALF_MAX = 65504.0  # the largest finite float16
_SIGN_AND_HALF_BITS = np.array(0x8FFFE000, dtype=np.uint32).view(np.int32)
_TORCH_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}  # torch dtype name -> code
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d{1,9})\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$",
    re.ASCII,  # a layer index is ASCII digits, never another script's (int() would read those too)
)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a weights file: its dtype, its shape and its bytes (little-endian, row-major).

    `dtype` is a safetensors code ("F16", "BF16", "F32", "F64"; any other code is refused by
    validation). `data` is a flat uint8 array over the bytes, writable, so that the worker can
    view it as a torch tensor without a copy.
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 [nbytes]

    @property
    def dtype_name(self) -> str:
        return WEIGHT_DTYPES[self.dtype][0] if self.dtype in WEIGHT_DTYPES else self.dtype


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter that passed every check, its weights still as read (numpy, no torch)."""

    config: LoraConfig
    weights: dict[tuple[int, str], tuple[StoredTensor, StoredTensor]]  # (layer, module) -> (lora_A, lora_B)

    @cached_property
    def modules(self) -> tuple[str, ...]:
        """The targeted projections, in LORA_MODULES order."""
        present = {module for _, module in self.weights}
        return tuple(m for m in LORA_MODULES if m in present)

    @cached_property
    def layers(self) -> tuple[int, ...]:
        """The layers that carry weights, ascending."""
        return tuple(sorted({layer for layer, _ in self.weights}))


def check_adapter_bytes(
    config_json: bytes | memoryview | str,
    weights: bytes | memoryview,
    model: ModelConfig,
    max_rank: int,
    weights_format: str = "safetensors",
) -> CheckedAdapter:
    """Validate an adapter given as the bytes of its two files, cheapest checks first."""
    config = parse_lora_config(config_json, model, max_rank)
    tensors = read_tensors(weights, weights_format)
    return check_weights(config, tensors, model)


# ---- reading -----------------------------------------------------------------------------------
def read_tensors(weights: bytes | memoryview, fmt: str) -> dict[str, StoredTensor]:
    """Every tensor of a weights file by name; a file that is not one raises InvalidAdapterError."""
    if fmt == "safetensors":
        try:  # safetensors' own parser checks the header, offsets, dtypes and sizes
            items = safetensors.deserialize(bytes(weights))
        except Exception as e:  # safetensors raises its own error types for every malformation
            raise InvalidAdapterError(f"{SAFETENSORS_FILE} is not a valid safetensors file: {e}") from None
        return {
            name: StoredTensor(t["dtype"], tuple(t["shape"]), np.frombuffer(t["data"], dtype=np.uint8))
            for name, t in items
        }
    if fmt == "bin":
        return _read_bin(weights)
    raise InvalidAdapterError(f"unknown adapter weights format {fmt!r} (safetensors or bin)")


def _read_bin(weights: bytes | memoryview) -> dict[str, StoredTensor]:
    """A torch.save'd dict of tensors, unpickled with torch's weights_only loader (no code runs)."""
    import torch  # here only: the safetensors path, and so the store and the gateway, never load torch

    try:
        state = torch.load(io.BytesIO(bytes(weights)), map_location="cpu", weights_only=True)
    except Exception as e:
        raise InvalidAdapterError(f"{BIN_FILE} could not be read as plain tensors (weights_only): {e}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InvalidAdapterError(f"{BIN_FILE} must hold a dict of tensors")
    tensors = {}
    for name, tensor in state.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        try:
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        except Exception as e:  # a dtype numpy cannot hold as bytes (quantized, say)
            raise InvalidAdapterError(f"{BIN_FILE}: tensor {show(name)} of dtype {dtype} cannot be read: {e}") from None
        tensors[name] = StoredTensor(_TORCH_CODES.get(dtype, dtype), tuple(tensor.shape), data)
    return tensors


# ---- validation --------------------------------------------------------------------------------
def check_weights(config: LoraConfig, tensors: dict[str, StoredTensor], model: ModelConfig) -> CheckedAdapter:
    """Check the tensors against the config and the base model: names, coverage, shapes, values."""
    found = _index_tensors(tensors, model)
    missing = sorted(config.targets - set(found))
    extra = sorted(set(found) - config.targets)
    if missing:
        layer, module = missing[0]
        raise InvalidAdapterError(
            f"adapter weights are missing {module} of layer {layer} ({len(missing)} targeted projection(s) "
            f"have no lora_A/lora_B), although {CONFIG_FILE} targets them"
        )
    if extra:
        layer, module = extra[0]
        raise InvalidAdapterError(
            f"adapter weights hold {module} of layer {layer}, which {CONFIG_FILE} does not target "
            "(target_modules / layers_to_transform)"
        )
    weights = {}
    for (layer, module), pair in sorted(found.items()):
        a, b = pair.get("A"), pair.get("B")
        where = f"layer {layer} {module}"
        if a is None or b is None:
            raise InvalidAdapterError(f"{where}: lora_{'A' if a is None else 'B'}.weight is missing")
        _check_shapes(where, a, b, config.rank, model.module_shape(module))
        _check_magnitudes(where, a, b, config.scale)
        weights[(layer, module)] = (a, b)
    return CheckedAdapter(config, weights)


def _index_tensors(
    tensors: dict[str, StoredTensor], model: ModelConfig
) -> dict[tuple[int, str], dict[str, StoredTensor]]:
    found: dict[tuple[int, str], dict[str, StoredTensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if not match:
            if "lora_magnitude_vector" in name:
                raise InvalidAdapterError(f"tensor {show(name)}: DoRA magnitude vectors are not supported")
            if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
                raise InvalidAdapterError(f"tensor {show(name)}: LoRA on embeddings / lm_head is not supported")
            raise InvalidAdapterError(f"unexpected tensor {show(name)} in the adapter weights")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in LORA_MODULES or PARENT[module] != parent:
            raise InvalidAdapterError(
                f"tensor {show(name)}: {parent}.{module} is not a projection of a {model.model_type} model"
            )
        if layer >= model.num_layers:
            raise InvalidAdapterError(
                f"tensor {show(name)}: layer {layer} does not exist (the model has {model.num_layers})"
            )
        slot = found.setdefault((layer, module), {})
        if which in slot:
            raise InvalidAdapterError(f"tensor {show(name)} appears twice")
        slot[which] = tensor
    if not found:
        raise InvalidAdapterError("the adapter weights hold no lora_A / lora_B tensors")
    return found


def _check_shapes(where: str, a: StoredTensor, b: StoredTensor, rank: int, shape: tuple[int, int]) -> None:
    d_in, d_out = shape
    if a.shape != (rank, d_in):
        raise InvalidAdapterError(
            f"{where}: lora_A has shape {list(a.shape)}, expected [{rank}, {d_in}] "
            f"(rank {rank}; the base model's projection takes {d_in} inputs) - adapter for another model?"
        )
    if b.shape != (d_out, rank):
        raise InvalidAdapterError(
            f"{where}: lora_B has shape {list(b.shape)}, expected [{d_out}, {rank}] "
            f"(the base model's projection has {d_out} outputs) - adapter for another model?"
        )


def _check_magnitudes(where: str, a: StoredTensor, b: StoredTensor, scale: float) -> None:
    """Finite weights of a size that can be meant (MAX_ABS_WEIGHT, MAX_UPDATE_NORM).

    One pass per tensor widens it (float16, bfloat16) and two find NaN, infinities and the largest
    magnitude at once. ‖scale·B·A‖_F is computed exactly without forming the [d_out, d_in] product:
    ‖BA‖_F² = Σ (AAᵀ ∘ BᵀB), two [r, r] Gram matrices, each made as soon as its tensor passed (float32
    cannot overflow here, since every entry is at most MAX_ABS_WEIGHT by then).
    """
    grams = []  # AAᵀ, BᵀB
    for tag, t in (("lora_A", a), ("lora_B", b)):
        if t.dtype not in WEIGHT_DTYPES:
            raise InvalidAdapterError(
                f"{where}: {tag} has dtype {t.dtype_name}; expected a floating-point type "
                "(float16, bfloat16, float32 or float64)"
            )
        wide, peak = _values_and_peak(t)
        if not math.isfinite(peak):
            raise InvalidAdapterError(f"{where}: {tag} contains NaN or infinite values")
        if peak > MAX_ABS_WEIGHT:
            raise InvalidAdapterError(
                f"{where}: {tag} holds a weight of magnitude {peak:.3g}, above the limit {MAX_ABS_WEIGHT:g} "
                "(trained LoRA weights stay below about 1): the file is corrupt or was scaled by mistake"
            )
        wide = wide.astype(np.float32, copy=False)
        grams.append(wide @ wide.T if t is a else wide.T @ wide)
    norm = abs(scale) * math.sqrt(max(0.0, float((grams[0] * grams[1]).sum())))
    if not norm <= MAX_UPDATE_NORM:
        raise InvalidAdapterError(
            f"{where}: the update scale·B·A has Frobenius norm {norm:.3g} (scale {scale:.3g} from lora_alpha "
            f"and r), above the limit {MAX_UPDATE_NORM:g} (trained adapters are about the size of the base "
            "projection, ~10-100): check lora_alpha and how the weights were scaled"
        )


def _values_and_peak(t: StoredTensor) -> tuple[np.ndarray, float]:
    """A weight tensor's values, exactly (float16 and bfloat16 widened to float32, float32 and
    float64 as stored, without a copy), and its largest magnitude: NaN or inf if any value is not finite.

    One min and one max pass find the magnitude (NaN propagates through both and np.maximum).
    """
    stored = t.data.view(WEIGHT_DTYPES[t.dtype][1]).reshape(t.shape)
    if t.dtype == "F16":
        values = _widen_half(stored)
        peak = float(np.maximum(-values.min(), values.max()))
        return values, (math.nan if peak > _HALF_MAX else peak)
    if t.dtype == "BF16":  # a bfloat16 is the top half of a float32: shifting its bits up widens it
        values = stored.astype(np.uint32)
        values <<= 16
        stored = values.view(np.float32)
    return stored, float(np.maximum(-stored.min(), stored.max()))


def _widen_half(half: np.ndarray) -> np.ndarray:
    """float16 -> float32, exact for every finite value, in four vectorized passes (numpy's own cast
    is scalar on most CPUs, ~5x slower). A half's exponent and mantissa, shifted into a float32's
    bit positions, read as that half times 2^-112 (subnormals included); the multiply restores it.
    NaN and infinities come out finite but above any finite half (≥ 2^16 > 65504): the caller's
    magnitude check refuses them.
    """
    bits = half.view(np.int16).astype(np.int32)  # sign-extended: a negative half sets bits 15-31
    bits <<= 13
    bits &= _SIGN_AND_HALF_BITS  # keep the sign (bit 31) and the half's 15 magnitude bits (13-27)
    values = bits.view(np.float32)
    values *= np.float32(2.0**112)
    return values
