"""PEFT LoRA adapters: read, validate against the base model, and pack into pool rows.

An adapter is `adapter_config.json` + `adapter_model.safetensors` (or, read with
`torch.load(weights_only=True)`, `adapter_model.bin`), from a directory or from bytes in memory.
Everything is checked before the adapter can reach the pool; each failure raises
`InvalidAdapterError` with a message that names the file, field or tensor at fault.

Semantics are PEFT's: for a targeted projection, y = x W^T + scale · (x A^T) B^T with
A = lora_A.weight [r, d_in], B = lora_B.weight [d_out, r], scale = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora).
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from loraserve.errors import InvalidAdapterError
from loraserve.worker.model_config import LORA_MODULES, ModelConfig
from loraserve.worker.pool_layout import AdapterLayout, PoolLayout

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

_PARENT = {m: ("self_attn" if m in LORA_MODULES[:4] else "mlp") for m in LORA_MODULES}
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
# Features PEFT supports that loraserve refuses (config key -> why), checked when set to a truthy value.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "modules_to_save": "modules_to_save (fully fine-tuned extra modules) is not supported",
    "lora_bias": "LoRA bias terms (lora_bias) are not supported",
    "fan_in_fan_out": "fan_in_fan_out is for GPT-2 style Conv1D layers, which Llama-family models do not have",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported; use one rank for the whole adapter",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "target_parameters": "LoRA on raw parameters (target_parameters) is not supported",
    "trainable_token_indices": "trainable tokens (trainable_token_indices) are not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QALoRA adapters are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
}
_EMBEDDING_TARGETS = {"embed_tokens", "lm_head", "wte", "embeddings"}


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter in host memory."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    modules: tuple[str, ...]  # targeted projections, in LORA_MODULES order
    layers: tuple[int, ...]  # layers that carry weights
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B)
    config: dict

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def layout(self, pool: PoolLayout, model: ModelConfig) -> AdapterLayout:
        return pool.adapter_layout(model, self.rank, self.modules, active_layers=len(self.layers))

    def pack(self, pool: PoolLayout, model: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
        """The adapter's logical rows for every layer, as pool.py lays them out.

        Shape: [num_layers, layout.num_rows, row_width]; layers without weights are zero.
        """
        layout = self.layout(pool, model)
        w = pool.row_width
        rows = torch.zeros(pool.num_layers, layout.num_rows, w, dtype=dtype)
        for (layer, module), (a, b) in self.weights.items():
            block = layout.block(module)
            assert block is not None
            r = self.rank
            a_rows = _chunk_rows(a, block.c_in, w)  # [r * c_in, W]
            b_rows = _chunk_rows(b.t(), block.c_out, w)  # [r * c_out, W]
            rows[layer, block.a_offset : block.a_offset + r * block.c_in] = a_rows
            rows[layer, block.b_offset : block.b_offset + r * block.c_out] = b_rows
        return rows


def _chunk_rows(matrix: torch.Tensor, chunks: int, width: int) -> torch.Tensor:
    """[r, d] -> [r * chunks, width]: each rank vector cut into row-sized chunks, the last zero-padded."""
    r, d = matrix.shape
    padded = torch.zeros(r, chunks * width, dtype=matrix.dtype)
    padded[:, :d] = matrix
    return padded.view(r * chunks, width)


# ---- reading -----------------------------------------------------------------------------------
def load_adapter_dir(path: str | Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and validate a PEFT adapter directory."""
    path = Path(path)
    if not path.is_dir():
        raise InvalidAdapterError(f"{path} is not a directory holding {CONFIG_FILE} and {SAFETENSORS_FILE}")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise InvalidAdapterError(f"{path} has no {CONFIG_FILE}")
    if (path / SAFETENSORS_FILE).is_file():
        weights, fmt = (path / SAFETENSORS_FILE).read_bytes(), "safetensors"
    elif (path / BIN_FILE).is_file():
        weights, fmt = (path / BIN_FILE).read_bytes(), "bin"
    else:
        raise InvalidAdapterError(f"{path} has no {SAFETENSORS_FILE} (or {BIN_FILE})")
    return load_adapter_bytes(config_path.read_bytes(), weights, model, max_rank, weights_format=fmt)


def load_adapter_bytes(
    config_json: bytes | str,
    weights: bytes | memoryview,
    model: ModelConfig,
    max_rank: int,
    weights_format: str = "safetensors",
) -> LoraAdapter:
    """Validate an adapter given as the bytes of its two files."""
    try:
        config = json.loads(bytes(config_json) if isinstance(config_json, memoryview) else config_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidAdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidAdapterError(f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}")
    tensors = _read_tensors(weights, weights_format)
    return validate_adapter(config, tensors, model, max_rank)


def _read_tensors(weights: bytes | memoryview, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "safetensors":
        try:
            return load_safetensors(bytes(weights))
        except Exception as e:  # safetensors raises its own error types for every malformation
            raise InvalidAdapterError(f"{SAFETENSORS_FILE} is not a valid safetensors file: {e}") from None
    if fmt == "bin":
        try:
            state = torch.load(io.BytesIO(bytes(weights)), map_location="cpu", weights_only=True)
        except Exception as e:
            raise InvalidAdapterError(f"{BIN_FILE} could not be read as plain tensors (weights_only): {e}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise InvalidAdapterError(f"{BIN_FILE} must hold a dict of tensors")
        return state
    raise InvalidAdapterError(f"unknown adapter weights format {fmt!r} (safetensors or bin)")


# ---- validation --------------------------------------------------------------------------------
def validate_adapter(config: dict, tensors: dict[str, torch.Tensor], model: ModelConfig, max_rank: int) -> LoraAdapter:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InvalidAdapterError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not a LoRA adapter")
    for key, why in _UNSUPPORTED.items():
        if config.get(key):
            raise InvalidAdapterError(f"{CONFIG_FILE}: {why}")
    if config.get("bias", "none") != "none":
        raise InvalidAdapterError(f"{CONFIG_FILE}: bias={config['bias']!r} is not supported; only bias='none'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidAdapterError(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise InvalidAdapterError(f"{CONFIG_FILE}: rank {rank} exceeds this server's max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InvalidAdapterError(f"{CONFIG_FILE}: lora_alpha must be a finite number, got {alpha!r}")
    expected = _targeted(config, model)
    found = _index_tensors(tensors, model)
    missing = sorted(expected - set(found))
    extra = sorted(set(found) - expected)
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
        d_in, d_out = model.module_shape(module)
        if tuple(a.shape) != (rank, d_in):
            raise InvalidAdapterError(
                f"{where}: lora_A has shape {list(a.shape)}, expected [{rank}, {d_in}] "
                f"(rank {rank}; the base model's {module} takes {d_in} inputs) - adapter for another model?"
            )
        if tuple(b.shape) != (d_out, rank):
            raise InvalidAdapterError(
                f"{where}: lora_B has shape {list(b.shape)}, expected [{d_out}, {rank}] "
                f"(the base model's {module} has {d_out} outputs) - adapter for another model?"
            )
        for tag, t in (("lora_A", a), ("lora_B", b)):
            if not t.is_floating_point():
                raise InvalidAdapterError(f"{where}: {tag} has dtype {t.dtype}, expected a floating-point type")
            if not torch.isfinite(t).all():
                raise InvalidAdapterError(f"{where}: {tag} contains NaN or infinite values")
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    modules = tuple(m for m in LORA_MODULES if any(m == mod for _, mod in weights))
    return LoraAdapter(
        rank=rank,
        lora_alpha=float(alpha),
        use_rslora=bool(config.get("use_rslora", False)),
        modules=modules,
        layers=tuple(sorted({layer for layer, _ in weights})),
        weights=weights,
        config=config,
    )


def _module_names(model: ModelConfig) -> dict[str, tuple[int, str]]:
    """Full module names as in the HF model ("model.layers.3.self_attn.q_proj") -> (layer, module)."""
    return {
        f"model.layers.{layer}.{_PARENT[m]}.{m}": (layer, m) for layer in range(model.num_layers) for m in LORA_MODULES
    }


def _targeted(config: dict, model: ModelConfig) -> set[tuple[int, str]]:
    """The (layer, module) pairs the config targets, resolved as PEFT resolves them."""
    target = config.get("target_modules")
    names = _module_names(model)
    if target is None:
        raise InvalidAdapterError(f"{CONFIG_FILE}: target_modules is missing")
    if isinstance(target, str) and target.lower() == "all-linear":
        chosen = set(names.values())
    elif isinstance(target, str):
        try:
            pattern = re.compile(target)
        except re.error as e:
            raise InvalidAdapterError(f"{CONFIG_FILE}: target_modules regex {target!r} is invalid: {e}") from None
        chosen = {pair for name, pair in names.items() if pattern.fullmatch(name)}
        if not chosen:
            raise InvalidAdapterError(
                f"{CONFIG_FILE}: target_modules regex {target!r} matches none of this {model.model_type} "
                "model's projections (q_proj ... down_proj) - adapter for another architecture?"
            )
    elif isinstance(target, list) and all(isinstance(t, str) for t in target) and target:
        leaves = {t.rsplit(".", 1)[-1] for t in target}
        embedding = sorted(leaves & _EMBEDDING_TARGETS)
        if embedding:
            raise InvalidAdapterError(
                f"{CONFIG_FILE}: LoRA on {', '.join(embedding)} (embeddings / lm_head) is not supported"
            )
        unknown = sorted(leaves - set(LORA_MODULES))
        if unknown:
            raise InvalidAdapterError(
                f"{CONFIG_FILE}: target_modules {unknown} are not projections of a {model.model_type} model "
                f"(supported: {', '.join(LORA_MODULES)}) - adapter for another architecture?"
            )
        chosen = {pair for name, pair in names.items() if any(name == t or name.endswith("." + t) for t in target)}
    else:
        raise InvalidAdapterError(f"{CONFIG_FILE}: target_modules must be a non-empty list of names or a string")
    excluded = config.get("exclude_modules")
    if excluded:
        raise InvalidAdapterError(f"{CONFIG_FILE}: exclude_modules is not supported")
    layers = config.get("layers_to_transform")
    if layers is not None:
        wanted = {layers} if isinstance(layers, int) else set(layers) if isinstance(layers, list) else None
        if wanted is None or not all(isinstance(x, int) for x in wanted):
            raise InvalidAdapterError(f"{CONFIG_FILE}: layers_to_transform must be an integer or a list of integers")
        bad = sorted(x for x in wanted if not 0 <= x < model.num_layers)
        if bad:
            raise InvalidAdapterError(
                f"{CONFIG_FILE}: layers_to_transform {bad} out of range; the base model has {model.num_layers} layers"
            )
        pattern = config.get("layers_pattern")
        if pattern not in (None, "layers", ["layers"]):
            raise InvalidAdapterError(f"{CONFIG_FILE}: layers_pattern {pattern!r} does not name this model's layers")
        chosen = {(layer, m) for layer, m in chosen if layer in wanted}
    return chosen


def _index_tensors(
    tensors: dict[str, torch.Tensor], model: ModelConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if not match:
            if "lora_magnitude_vector" in name:
                raise InvalidAdapterError(f"tensor {name!r}: DoRA magnitude vectors are not supported")
            if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
                raise InvalidAdapterError(f"tensor {name!r}: LoRA on embeddings / lm_head is not supported")
            raise InvalidAdapterError(f"unexpected tensor {name!r} in the adapter weights")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in LORA_MODULES or _PARENT[module] != parent:
            raise InvalidAdapterError(
                f"tensor {name!r}: {parent}.{module} is not a projection of a {model.model_type} model"
            )
        if layer >= model.num_layers:
            raise InvalidAdapterError(
                f"tensor {name!r}: layer {layer} does not exist (the model has {model.num_layers})"
            )
        slot = found.setdefault((layer, module), {})
        if which in slot:
            raise InvalidAdapterError(f"tensor {name!r} appears twice")
        slot[which] = tensor
    if not found:
        raise InvalidAdapterError("the adapter weights hold no lora_A / lora_B tensors")
    return found
