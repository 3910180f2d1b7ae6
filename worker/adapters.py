"""PEFT LoRA adapters: read, validate against the base model, and pack into pool rows.

An adapter is `adapter_config.json` + `adapter_model.safetensors` (or, read with
`torch.load(weights_only=True)`, `adapter_model.bin`), from a directory or from bytes in memory.
Everything is checked before the adapter can reach the pool; each failure raises
`InvalidAdapterError` with a message that names the file, field or tensor at fault.

Semantics are PEFT's: for a targeted projection, y = x W^T + scale · (x A^T) B^T with
A = lora_A.weight [r, d_in], B = lora_B.weight [d_out, r], scale = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora).

Everything here reads untrusted bytes (an upload to the store), so no input may cost more than
its size: a `target_modules` regex is matched by RE2 (linear time, no backtracking), a JSON
nesting too deep to parse is an invalid config, and weights too large to be meant are refused
(limits below; docs/architecture.md, "What is validated, and the limits").
"""

from __future__ import annotations

import io
import json
import math
import re
import reprlib
from dataclasses import dataclass, replace
from pathlib import Path

import re2
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
    r"^(?:base_model\.model\.)?model\.layers\.(\d{1,9})\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$",
    re.ASCII,  # a layer index is ASCII digits, never another script's (int() would read those too)
)
# Trained LoRA weights stay well below 1 in magnitude (PEFT starts A within ±1/sqrt(d_in) and B at
# 0), and the update scale·B·A is of the order of the base projection it adapts (Frobenius norm
# ~10-100 at 7B). These bounds sit orders of magnitude above that: what exceeds them cannot be
# meant, and would overflow activations (float16 tops out at 65504) into NaN for its requests.
MAX_ABS_WEIGHT = 1e3
MAX_UPDATE_NORM = 1e4
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_REPR = reprlib.Repr()  # config values in error messages: whatever the upload, a short string
_REPR.maxstring = _REPR.maxother = 120
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is the user's error, reported to them, not logged by RE2
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
    sha256: str | None = None  # hex SHA-256 of the weights file it was read from, when the caller checked it

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
    sha256: str | None = None,
) -> LoraAdapter:
    """Validate an adapter given as the bytes of its two files.

    `sha256`: the weights' content hash, already checked by the caller (the worker's fetcher); kept
    on the adapter so the host cache can tell two contents of one (name, version) apart.
    """
    config = _parse_config(config_json)
    tensors = _read_tensors(weights, weights_format)
    adapter = validate_adapter(config, tensors, model, max_rank)
    return adapter if sha256 is None else replace(adapter, sha256=sha256)


def _parse_config(config_json: bytes | memoryview | str) -> dict:
    """The config's JSON object. Every way the text can fail to be one is the uploader's error:
    malformed text, a bad encoding, an integer too long to convert (ValueError), or nesting too
    deep for the parser's recursion (RecursionError: `[[[...]]]` 100,000 deep is 200 KB)."""
    try:
        config = json.loads(bytes(config_json) if isinstance(config_json, memoryview) else config_json)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
        raise InvalidAdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidAdapterError(f"{CONFIG_FILE} nests arrays or objects too deeply to be a config") from None
    if not isinstance(config, dict):
        raise InvalidAdapterError(f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}")
    return config


def _show(value: object) -> str:
    """A config value for an error message: bounded in length and depth, whatever was uploaded."""
    return _REPR.repr(value)


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
    rank, alpha = _check_config(config, max_rank)
    use_rslora = bool(config.get("use_rslora", False))
    scale = alpha / (math.sqrt(rank) if use_rslora else rank)
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
        _check_shapes(where, a, b, rank, model.module_shape(module))
        _check_magnitudes(where, a, b, scale)
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    modules = tuple(m for m in LORA_MODULES if any(m == mod for _, mod in weights))
    return LoraAdapter(
        rank=rank,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        modules=modules,
        layers=tuple(sorted({layer for layer, _ in weights})),
        weights=weights,
        config=config,
    )


def _check_config(config: dict, max_rank: int) -> tuple[int, float]:
    """The scalar fields: what kind of adapter this is, (rank, lora_alpha)."""
    peft_type = config.get("peft_type", "LORA")
    if not (isinstance(peft_type, str) and peft_type.upper() == "LORA"):
        raise InvalidAdapterError(f"{CONFIG_FILE}: peft_type {_show(peft_type)} is not a LoRA adapter")
    for key, why in _UNSUPPORTED.items():
        if config.get(key):
            raise InvalidAdapterError(f"{CONFIG_FILE}: {why}")
    if config.get("bias", "none") != "none":
        raise InvalidAdapterError(f"{CONFIG_FILE}: bias={_show(config['bias'])} is not supported; only bias='none'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidAdapterError(f"{CONFIG_FILE}: r must be a positive integer, got {_show(rank)}")
    if rank > max_rank:
        raise InvalidAdapterError(f"{CONFIG_FILE}: rank {rank} exceeds this server's max_lora_rank {max_rank}")
    alpha = _finite_float(config.get("lora_alpha", 8))
    if alpha is None:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: lora_alpha must be a finite number, got {_show(config['lora_alpha'])}"
        )
    return rank, alpha


def _finite_float(value: object) -> float | None:
    """A JSON number as a finite float; None for anything else (a bool, NaN, an integer beyond float's range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _check_shapes(where: str, a: torch.Tensor, b: torch.Tensor, rank: int, shape: tuple[int, int]) -> None:
    d_in, d_out = shape
    if tuple(a.shape) != (rank, d_in):
        raise InvalidAdapterError(
            f"{where}: lora_A has shape {list(a.shape)}, expected [{rank}, {d_in}] "
            f"(rank {rank}; the base model's projection takes {d_in} inputs) - adapter for another model?"
        )
    if tuple(b.shape) != (d_out, rank):
        raise InvalidAdapterError(
            f"{where}: lora_B has shape {list(b.shape)}, expected [{d_out}, {rank}] "
            f"(the base model's projection has {d_out} outputs) - adapter for another model?"
        )


def _check_magnitudes(where: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """Finite weights of a size that can be meant (MAX_ABS_WEIGHT, MAX_UPDATE_NORM).

    One aminmax pass per tensor finds NaN, infinities and the largest magnitude at once (NaN
    propagates). ||scale·B·A||_F is computed exactly without forming the [d_out, d_in] product:
    ||BA||_F² = Σ (AAᵀ ∘ BᵀB), two [r, r] Gram matrices (float32 cannot overflow here, since every
    entry is at most MAX_ABS_WEIGHT by then).
    """
    for tag, t in (("lora_A", a), ("lora_B", b)):
        if t.dtype not in _WEIGHT_DTYPES:
            raise InvalidAdapterError(
                f"{where}: {tag} has dtype {t.dtype}; expected a floating-point type "
                "(float16, bfloat16, float32 or float64)"
            )
        low, high = torch.aminmax(t)
        peak = float(torch.maximum(-low, high))
        if not math.isfinite(peak):
            raise InvalidAdapterError(f"{where}: {tag} contains NaN or infinite values")
        if peak > MAX_ABS_WEIGHT:
            raise InvalidAdapterError(
                f"{where}: {tag} holds a weight of magnitude {peak:.3g}, above the limit {MAX_ABS_WEIGHT:g} "
                "(trained LoRA weights stay below about 1): the file is corrupt or was scaled by mistake"
            )
    a32, b32 = a.float(), b.float()
    norm = abs(scale) * math.sqrt(max(0.0, float(((a32 @ a32.T) * (b32.T @ b32)).sum())))
    if not norm <= MAX_UPDATE_NORM:
        raise InvalidAdapterError(
            f"{where}: the update scale·B·A has Frobenius norm {norm:.3g} (scale {scale:.3g} from lora_alpha "
            f"and r), above the limit {MAX_UPDATE_NORM:g} (trained adapters are about the size of the base "
            "projection, ~10-100): check lora_alpha and how the weights were scaled"
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
        chosen = _regex_targets(target, names, model)
    elif isinstance(target, list) and all(isinstance(t, str) for t in target) and target:
        chosen = _listed_targets(target, names, model)
    else:
        raise InvalidAdapterError(f"{CONFIG_FILE}: target_modules must be a non-empty list of names or a string")
    if config.get("exclude_modules"):
        raise InvalidAdapterError(f"{CONFIG_FILE}: exclude_modules is not supported")
    layers = config.get("layers_to_transform")
    if layers is not None:
        wanted = _wanted_layers(layers, config.get("layers_pattern"), model)
        chosen = {(layer, m) for layer, m in chosen if layer in wanted}
    return chosen


def _regex_targets(target: str, names: dict[str, tuple[int, str]], model: ModelConfig) -> set[tuple[int, str]]:
    r"""PEFT's rule for a string: the regex must match a module's whole name (re.fullmatch).

    Matched by RE2, not `re`: a backtracking engine takes exponential time on patterns such as
    `model\.layer(.*)*(.*)*X` (half a minute for a 1 KB upload, doubling per character), while
    RE2 is linear in the name's length. RE2 has no backreferences or lookaround; a pattern using
    them is refused rather than matched by a slower engine.
    """
    try:
        pattern = re2.compile(target, _RE2_OPTIONS)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: target_modules regex {_show(target)} cannot be used: {why} (patterns are matched "
            "with RE2 syntax: no backreferences or lookaround; a list of module names also works)"
        ) from None
    chosen = {pair for name, pair in names.items() if pattern.fullmatch(name)}
    if not chosen:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: target_modules regex {_show(target)} matches none of this {model.model_type} "
            "model's projections (q_proj ... down_proj) - adapter for another architecture?"
        )
    return chosen


def _listed_targets(target: list[str], names: dict[str, tuple[int, str]], model: ModelConfig) -> set[tuple[int, str]]:
    """PEFT's rule for a list: a module is targeted if its name equals or ends with "." + an entry."""
    leaves = {t.rsplit(".", 1)[-1] for t in target}
    embedding = sorted(leaves & _EMBEDDING_TARGETS)
    if embedding:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: LoRA on {', '.join(embedding)} (embeddings / lm_head) is not supported"
        )
    unknown = sorted(leaves - set(LORA_MODULES))
    if unknown:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: target_modules {_show(unknown)} are not projections of a {model.model_type} model "
            f"(supported: {', '.join(LORA_MODULES)}) - adapter for another architecture?"
        )
    return {pair for name, pair in names.items() if any(name == t or name.endswith("." + t) for t in target)}


def _wanted_layers(layers: object, pattern: object, model: ModelConfig) -> set[int]:
    """layers_to_transform (an integer or a list of integers) as a set of existing layer indices."""
    items = [layers] if isinstance(layers, int) else layers if isinstance(layers, list) else None
    if items is None or not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        raise InvalidAdapterError(f"{CONFIG_FILE}: layers_to_transform must be an integer or a list of integers")
    bad = sorted(x for x in set(items) if not 0 <= x < model.num_layers)
    if bad:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: layers_to_transform {_show(bad)} out of range; "
            f"the base model has {model.num_layers} layers"
        )
    if pattern not in (None, "layers", ["layers"]):
        raise InvalidAdapterError(f"{CONFIG_FILE}: layers_pattern {_show(pattern)} does not name this model's layers")
    return set(items)


def _index_tensors(
    tensors: dict[str, torch.Tensor], model: ModelConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if not match:
            if "lora_magnitude_vector" in name:
                raise InvalidAdapterError(f"tensor {_show(name)}: DoRA magnitude vectors are not supported")
            if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
                raise InvalidAdapterError(f"tensor {_show(name)}: LoRA on embeddings / lm_head is not supported")
            raise InvalidAdapterError(f"unexpected tensor {_show(name)} in the adapter weights")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in LORA_MODULES or _PARENT[module] != parent:
            raise InvalidAdapterError(
                f"tensor {_show(name)}: {parent}.{module} is not a projection of a {model.model_type} model"
            )
        if layer >= model.num_layers:
            raise InvalidAdapterError(
                f"tensor {_show(name)}: layer {layer} does not exist (the model has {model.num_layers})"
            )
        slot = found.setdefault((layer, module), {})
        if which in slot:
            raise InvalidAdapterError(f"tensor {_show(name)} appears twice")
        slot[which] = tensor
    if not found:
        raise InvalidAdapterError("the adapter weights hold no lora_A / lora_B tensors")
    return found
