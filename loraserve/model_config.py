"""The base model's shape, read from a Hugging Face `config.json` (Llama, Mistral, Qwen2).

Torch-free: the gateway (context length, tokenizer), the adapter store (adapter validation) and the
worker all read it; the worker's torch side (rotary frequencies) lives in `worker/model.py`.

Every JSON file of a model directory is read with `read_json_object` (other text: `read_model_text`), and
every field read from one has its type checked (`_Fields`, `_Rope`, `token_ids`): a file that is not UTF-8,
not JSON or not an object, or a field of the wrong type, is an InvalidModelError naming the file and the
field, never a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from loraserve.errors import InvalidModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# The seven projections a LoRA adapter may target, in the order the pool lays out an adapter's
# blocks and the kernels' per-module tables (`LoraTables`) are indexed: module m is LORA_MODULES[m].
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_INDEX = {m: i for i, m in enumerate(LORA_MODULES)}
ATTENTION_MODULES = LORA_MODULES[:4]  # under self_attn; the other three under mlp
# Projections that read the same input, as module indices: q/k/v, o, gate/up, down. One LoRA shrink
# serves a whole group (its adapters' A blocks are stacked in the pool, see loraserve/pool_rows.py).
LORA_GROUPS = ((0, 1, 2), (3,), (4, 5), (6,))


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: `kind` is "default", "linear" or "llama3"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runner, the pool and adapter validation need to know about the base model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 (and Llama with attention_bias) add biases to q, k and v
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @property
    def kv_width(self) -> int:
        """Elements of one token's K (or V) in one layer: num_kv_heads × head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        h, q, kv, i = self.hidden_size, self.q_width, self.kv_width, self.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise InvalidModelError(f"{path} not found: a model directory needs config.json")
        return cls.from_hf(read_json_object(path), source=str(path))

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        if not isinstance(raw, dict):
            raise InvalidModelError(f"{source} must hold a JSON object, got {json_type(raw)}")
        typed(raw, _Fields, source)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidModelError(
                f"{source}: model_type {model_type!r} is not supported; "
                f"loraserve serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise InvalidModelError(f"{source}: {key} must be a positive integer, got {raw.get(key)!r}")
        if raw.get("hidden_act", "silu") != "silu":
            raise InvalidModelError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise InvalidModelError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        eos_ids = token_ids(raw.get("eos_token_id"), f"{source}: eos_token_id")
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope=_rope_from_hf(raw, source),
            sliding_window=window,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def _rope_from_hf(raw: dict, source: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    typed(params, _Rope, f"{source}: rope_parameters" if raw.get("rope_parameters") else f"{source}: rope_scaling")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise InvalidModelError(f"{source}: rope type {kind!r} is not supported (default, linear, llama3)")
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


class _Fields(msgspec.Struct):
    """The types of the config.json fields read besides the sizes (which `from_hf` checks itself); absent
    or null: the default `from_hf` gives it."""

    model_type: str | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str | None = None
    rms_norm_eps: float | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool | None = None
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    sliding_window: int | None = None
    use_sliding_window: bool | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    dtype: str | None = None
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None


class _Rope(msgspec.Struct):
    """The types of the rotary-embedding parameters read (`rope_parameters`, or the older `rope_scaling`)."""

    rope_theta: float | None = None
    rope_type: str | None = None
    type: str | None = None
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


def typed(raw: dict, fields: type[msgspec.Struct], source: str) -> None:
    """InvalidModelError naming `source` and the field when a field of `raw` that `fields` declares has
    another type (unknown fields are let through)."""
    try:
        msgspec.convert(raw, fields)
    except msgspec.ValidationError as e:
        message, _, path = str(e).partition(" - at `$.")
        where = f"{source}: {path.rstrip('`')}" if path else source
        raise InvalidModelError(f"{where}: {message[0].lower()}{message[1:]}") from None


def token_ids(value: Any, source: str) -> tuple[int, ...]:
    """A token id field (`eos_token_id`: one id, a list of them, or null) as a tuple of ids."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise InvalidModelError(f"{source} must be a token id or a list of them, got {value!r:.80}")
    return tuple(ids)


def read_json_object(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    """The JSON object `path` holds ({} when it is missing and `missing_ok`); InvalidModelError naming the file
    when it cannot be read, is not UTF-8 text, not JSON, or holds something other than an object."""
    if missing_ok and not path.exists():
        return {}
    try:
        raw = json.loads(read_model_text(path))
    except json.JSONDecodeError as e:
        raise InvalidModelError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise InvalidModelError(f"{path} must hold a JSON object, got {json_type(raw)}")
    return raw


def read_model_text(path: Path) -> str:
    """A text file of a model directory; InvalidModelError naming it when it is missing, cannot be read or
    is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidModelError(f"{path} not found") from None
    except UnicodeDecodeError as e:
        raise InvalidModelError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise InvalidModelError(f"{path} could not be read: {e.strerror or e}") from None


def json_type(value: Any) -> str:
    """What JSON calls the type of a value JSON decoded to."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


DEFAULT_MAX_LORA_RANK = 128  # the largest LoRA rank a stack serves unless told: engine, store and gateway alike
