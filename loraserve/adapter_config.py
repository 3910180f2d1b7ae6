"""A PEFT `adapter_config.json`, parsed and checked against the base model (torch-free).

Semantics are PEFT's: for a targeted projection, y = x W^T + scale · (x A^T) B^T with
scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). `target_modules` is "all-linear",
a regex that must match a module's whole name (re.fullmatch), or a list of names a module's name
equals or ends with; `layers_to_transform` narrows the layers.

The text is untrusted (an upload to the store), so no input may cost more than its size: a regex
is matched by RE2 (linear time, no backtracking), JSON nested too deeply to parse is an invalid
config, and config values shown in error messages are truncated. Every refusal raises
`InvalidAdapterError` naming the field (docs/architecture.md, "What is validated, and the limits").
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass

import re2

from loraserve.errors import InvalidAdapterError
from loraserve.model_config import ATTENTION_MODULES, LORA_MODULES, ModelConfig

CONFIG_FILE = "adapter_config.json"

# Where each projection sits in a decoder layer: model.layers.<i>.<parent>.<module>.
PARENT = {m: ("self_attn" if m in ATTENTION_MODULES else "mlp") for m in LORA_MODULES}
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


def lora_scale(lora_alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scale of the update B·A: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    return lora_alpha / (math.sqrt(rank) if use_rslora else rank)


@dataclass(frozen=True)
class LoraConfig:
    """An adapter_config.json that passed every check: the adapter's kind and what it targets."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    targets: frozenset[tuple[int, str]]  # (layer, module) pairs the config targets, resolved as PEFT does
    raw: dict  # the parsed JSON object, as uploaded

    @property
    def scale(self) -> float:
        return lora_scale(self.lora_alpha, self.rank, self.use_rslora)


def parse_lora_config(config_json: bytes | memoryview | str, model: ModelConfig, max_rank: int) -> LoraConfig:
    """Parse adapter_config.json and check it against the base model and the server's max rank."""
    raw = _parse_json(config_json)
    rank, alpha = _check_scalars(raw, max_rank)
    return LoraConfig(
        rank=rank,
        lora_alpha=alpha,
        use_rslora=bool(raw.get("use_rslora", False)),
        targets=frozenset(_targeted(raw, model)),
        raw=raw,
    )


def show(value: object) -> str:
    """A config value (or tensor name) for an error message: bounded in length and depth."""
    return _REPR.repr(value)


def _parse_json(config_json: bytes | memoryview | str) -> dict:
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


def _check_scalars(config: dict, max_rank: int) -> tuple[int, float]:
    """The scalar fields: what kind of adapter this is, (rank, lora_alpha)."""
    peft_type = config.get("peft_type", "LORA")
    if not (isinstance(peft_type, str) and peft_type.upper() == "LORA"):
        raise InvalidAdapterError(f"{CONFIG_FILE}: peft_type {show(peft_type)} is not a LoRA adapter")
    for key, why in _UNSUPPORTED.items():
        if config.get(key):
            raise InvalidAdapterError(f"{CONFIG_FILE}: {why}")
    if config.get("bias", "none") != "none":
        raise InvalidAdapterError(f"{CONFIG_FILE}: bias={show(config['bias'])} is not supported; only bias='none'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidAdapterError(f"{CONFIG_FILE}: r must be a positive integer, got {show(rank)}")
    if rank > max_rank:
        raise InvalidAdapterError(f"{CONFIG_FILE}: rank {rank} exceeds this server's max_lora_rank {max_rank}")
    alpha = _finite_float(config.get("lora_alpha", 8))
    if alpha is None:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: lora_alpha must be a finite number, got {show(config['lora_alpha'])}"
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


def _module_names(model: ModelConfig) -> dict[str, tuple[int, str]]:
    """Full module names as in the HF model ("model.layers.3.self_attn.q_proj") -> (layer, module)."""
    return {
        f"model.layers.{layer}.{PARENT[m]}.{m}": (layer, m) for layer in range(model.num_layers) for m in LORA_MODULES
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
            f"{CONFIG_FILE}: target_modules regex {show(target)} cannot be used: {why} (patterns are matched "
            "with RE2 syntax: no backreferences or lookaround; a list of module names also works)"
        ) from None
    chosen = {pair for name, pair in names.items() if pattern.fullmatch(name)}
    if not chosen:
        raise InvalidAdapterError(
            f"{CONFIG_FILE}: target_modules regex {show(target)} matches none of this {model.model_type} "
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
            f"{CONFIG_FILE}: target_modules {show(unknown)} are not projections of a {model.model_type} model "
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
            f"{CONFIG_FILE}: layers_to_transform {show(bad)} out of range; the base model has {model.num_layers} layers"
        )
    if pattern not in (None, "layers", ["layers"]):
        raise InvalidAdapterError(f"{CONFIG_FILE}: layers_pattern {show(pattern)} does not name this model's layers")
    return set(items)
