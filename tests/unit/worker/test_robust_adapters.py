"""Adapters whose numbers or config cannot be meant are refused at registration, cheaply.

Each case here used to get past validation and then hurt a role: weights scaled by 1e19 crashed
the worker mid-batch; a backtracking `target_modules` regex froze the adapter store for half a
minute per KB; a deeply nested adapter_config.json or a list where an integer belongs surfaced as
INTERNAL instead of INVALID_ARGUMENT. Real adapters (the demo's, PEFT-saved ones) must still pass,
and validating a 7B-shaped adapter must stay a matter of milliseconds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from loraserve.adapter_config import CONFIG_FILE
from loraserve.adapter_format import MAX_ABS_WEIGHT, MAX_UPDATE_NORM, SAFETENSORS_FILE
from loraserve.bench.common.llama7b_files import write_adapter, write_model
from loraserve.errors import InvalidAdapterError
from loraserve.model_config import ModelConfig
from loraserve.worker.adapters import load_adapter_bytes, load_adapter_dir

DEMO = Path(__file__).parents[3] / "demo"
CATASTROPHIC = r"model\.layer(.*)*(.*)*X"  # exponential for a backtracking engine: ~2 s per 31-char name


def _files(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((adapter_dir / CONFIG_FILE).read_text()), load_file(adapter_dir / SAFETENSORS_FILE)


def _load(config: dict | str, tensors: dict[str, torch.Tensor], model: ModelConfig):
    text = config if isinstance(config, str) else json.dumps(config)
    return load_adapter_bytes(text, save(tensors), model, max_rank=64)


@pytest.fixture(scope="module")
def tiny_config(tiny_model: Path) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model)


@pytest.fixture(scope="module")
def llama_7b(tmp_path_factory) -> ModelConfig:
    """A config.json only: Llama-7B's 32 layers × 7 projections, the module-name list a regex runs over."""
    return write_model(tmp_path_factory.mktemp("llama-7b"))


# ---- weights too large to be meant -----------------------------------------------------------
def test_real_adapters_are_within_the_bounds(tiny_config, tiny_adapters):
    demo_model = ModelConfig.from_dir(DEMO / "model")
    for path in sorted((DEMO / "adapters").iterdir()):
        load_adapter_dir(path, demo_model, max_rank=64)
    for path in tiny_adapters.values():
        load_adapter_dir(path, tiny_config, max_rank=64)


@pytest.mark.parametrize(
    ("factor", "match"),
    [(1e19, "magnitude .* above the limit"), (1e3, "Frobenius norm .* above the limit")],
    ids=["x1e19-entries", "x1e3-update"],
)
def test_scaled_weights_are_refused(tiny_config, tiny_adapters, factor: float, match: str):
    """×1e19: entries far past MAX_ABS_WEIGHT. ×1e3: every entry still below it (a real adapter's
    are < 1), but the update scale·B·A grows by 1e6 and passes MAX_UPDATE_NORM."""
    config, tensors = _files(tiny_adapters["r16-all-rslora"])
    assert max(float(t.abs().max()) for t in tensors.values()) * 1e3 < MAX_ABS_WEIGHT
    with pytest.raises(InvalidAdapterError, match=match):
        _load(config, {k: t * factor for k, t in tensors.items()}, tiny_config)


def test_a_huge_lora_alpha_is_refused(tiny_config, tiny_adapters):
    config, tensors = _files(tiny_adapters["r4-qv"])
    with pytest.raises(InvalidAdapterError, match=f"lora_alpha and r.*above the limit {MAX_UPDATE_NORM:g}"):
        _load({**config, "lora_alpha": 1e12}, tensors, tiny_config)
    with pytest.raises(InvalidAdapterError, match="lora_alpha must be a finite number"):
        _load(
            json.dumps(config).replace(f'"lora_alpha": {config["lora_alpha"]}', '"lora_alpha": 1' + "0" * 400),
            tensors,
            tiny_config,
        )


def test_float8_weights_are_refused(tiny_config, tiny_adapters):
    config, tensors = _files(tiny_adapters["r4-qv"])
    with pytest.raises(InvalidAdapterError, match="floating-point type"):
        _load(config, {k: t.to(torch.float8_e4m3fn) for k, t in tensors.items()}, tiny_config)


def test_a_7b_shaped_adapter_validates_in_milliseconds(tmp_path, llama_7b):
    """Rank 16 on q/k/v/o, float16: 33.6 MB. One pass per tensor plus two [r, r] Gram matrices
    (~50 ms); forming each B·A product would take seconds."""
    write_adapter(tmp_path, llama_7b, 16, ["q_proj", "k_proj", "v_proj", "o_proj"])
    config, weights = (tmp_path / CONFIG_FILE).read_bytes(), (tmp_path / SAFETENSORS_FILE).read_bytes()
    assert len(weights) > 33_000_000
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        load_adapter_bytes(config, weights, llama_7b, max_rank=16)
        best = min(best, time.perf_counter() - start)
    assert best < 0.5, f"validation took {best * 1e3:.0f} ms"


# ---- target_modules regexes ------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_catastrophic_regex_costs_milliseconds(llama_7b):
    config = {"r": 4, "lora_alpha": 8, "target_modules": CATASTROPHIC + "(a|aa)*" * 140}
    assert len(json.dumps(config)) > 1000
    start = time.perf_counter()
    with pytest.raises(InvalidAdapterError, match="matches none"):
        _load(config, {"x": torch.zeros(1)}, llama_7b)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("pattern", [r"(q)_proj\1", r"(?=.*q_proj).*", r".*(?<!k)_proj"])
def test_regexes_re2_cannot_run_are_refused(tiny_config, tiny_adapters, pattern: str):
    config, tensors = _files(tiny_adapters["r4-qv"])
    with pytest.raises(InvalidAdapterError, match="RE2"):
        _load({**config, "target_modules": pattern}, tensors, tiny_config)


@pytest.mark.parametrize(
    "pattern", [r".*\.(q_proj|v_proj)", r"model\.layers\.\d+\.self_attn\.[qv]_proj", r"^.*(q|v)_proj$"]
)
def test_peft_regex_semantics_are_kept(tiny_config, tiny_adapters, pattern: str):
    """A string is matched against each module's full name, as PEFT's re.fullmatch does."""
    config, tensors = _files(tiny_adapters["r4-qv"])
    listed = _load(config, tensors, tiny_config)
    matched = _load({**config, "target_modules": pattern}, tensors, tiny_config)
    assert matched.weights.keys() == listed.weights.keys() and matched.modules == ("q_proj", "v_proj")
    with pytest.raises(InvalidAdapterError, match="matches none"):
        _load({**config, "target_modules": "q_proj"}, tensors, tiny_config)  # a bare name is not a full match


# ---- configs that are not configs ------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"r": 4, "target_modules": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"r": 1' + "0" * 5000 + "}",  # past Python's int-from-string digit limit
    ],
    ids=["deep-array", "deep-field", "long-integer"],
)
def test_unparseable_configs_are_invalid_adapters(tiny_config, tiny_adapters, text: str):
    _, tensors = _files(tiny_adapters["r4-qv"])
    with pytest.raises(InvalidAdapterError, match=CONFIG_FILE) as caught:
        _load(text, tensors, tiny_config)
    assert caught.value.status == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    "field",
    [
        {"layers_to_transform": [[1]]},
        {"layers_to_transform": [True]},
        {"peft_type": [[["LORA"]]] * 50},
        {"target_modules": ["q_proj", "x" * 100_000]},
    ],
    ids=["unhashable-layers", "bool-layer", "listed-peft-type", "long-target"],
)
def test_wrong_types_are_invalid_adapters_with_short_messages(tiny_config, tiny_adapters, field: dict):
    config, tensors = _files(tiny_adapters["r4-qv"])
    with pytest.raises(InvalidAdapterError) as caught:
        _load({**config, **field}, tensors, tiny_config)
    assert len(str(caught.value)) < 600
