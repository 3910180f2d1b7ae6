"""Adapter validation: every bad adapter is refused with a specific message, and the pool is untouched."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy
from safetensors.torch import load_file, save_file

from loraserve.errors import InvalidAdapterError
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.sampling import SamplingParams

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, EngineConfig(device="cpu", pool_pages=64, max_lora_rank=32))


@pytest.fixture
def bad_adapter(tiny_adapters, tmp_path):
    """A copy of a valid adapter (rank 4 on q/v, both layers) to break in one way."""
    path = tmp_path / "bad"
    shutil.copytree(tiny_adapters["r4-qv"], path)
    return path


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, path / "adapter_model.safetensors")


def _assert_refused(engine: Engine, path: Path, message: str) -> None:
    pool_before = engine.pool.tensor.clone()
    stats_before = engine.stats()
    names_before = engine.registry.names()
    with pytest.raises(InvalidAdapterError, match=message):
        engine.register_adapter("bad", path)
    assert torch.equal(engine.pool.tensor, pool_before)
    assert engine.stats() == stats_before
    assert engine.registry.names() == names_before


CONFIG_CASES = {
    "dora": ({"use_dora": True}, "DoRA"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "bias": ({"bias": "all"}, "bias='all' is not supported"),
    "lm_head": ({"target_modules": ["q_proj", "lm_head"]}, r"lm_head .*not supported"),
    "embeddings": ({"target_modules": ["embed_tokens"]}, "embeddings"),
    "other_architecture": ({"target_modules": ["c_attn", "c_proj"]}, "another architecture"),
    "rank_too_big": ({"r": 64}, "exceeds this server's max_lora_rank 32"),
    "rank_zero": ({"r": 0}, "r must be a positive integer"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    "not_lora": ({"peft_type": "IA3"}, "not a LoRA adapter"),
    "layers_out_of_range": ({"layers_to_transform": [0, 7]}, r"layers_to_transform \[7\] out of range"),
    "alpha_nan": ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number"),
    "regex_matches_nothing": ({"target_modules": r".*\.c_fc"}, "matches none"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES), ids=list(CONFIG_CASES))
def test_bad_config_is_refused(engine, bad_adapter, case):
    changes, message = CONFIG_CASES[case]
    _edit_config(bad_adapter, **changes)
    _assert_refused(engine, bad_adapter, message)


def _first(tensors, suffix):
    return next(k for k in tensors if k.endswith(suffix))


TENSOR_CASES = {
    "nan": (
        lambda t: t[_first(t, "q_proj.lora_A.weight")].__setitem__((0, 0), float("nan")),
        "NaN or infinite",
    ),
    "inf": (
        lambda t: t[_first(t, "v_proj.lora_B.weight")].__setitem__((1, 1), float("inf")),
        "NaN or infinite",
    ),
    "missing": (lambda t: t.pop(_first(t, "0.self_attn.v_proj.lora_B.weight")), "lora_B.weight is missing"),
    "missing_module": (
        lambda t: [t.pop(k) for k in [k for k in t if ".1.self_attn.q_proj" in k]],
        "missing q_proj of layer 1",
    ),
    "extra_tensor": (
        lambda t: t.__setitem__("base_model.model.lm_head.weight", torch.zeros(4, 4)),
        "lm_head",
    ),
    "untargeted_module": (
        lambda t: t.update(
            {
                f"{PREFIX}.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
                f"{PREFIX}.0.mlp.up_proj.lora_B.weight": torch.zeros(88, 4),
            }
        ),
        "does not target",
    ),
    "dora_magnitude": (
        lambda t: t.__setitem__(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(64)),
        "DoRA",
    ),
    "wrong_shape": (
        lambda t: t.__setitem__(_first(t, "0.self_attn.q_proj.lora_A.weight"), torch.zeros(4, 128)),
        r"lora_A has shape \[4, 128\], expected \[4, 64\]",
    ),
    "integer_weights": (
        lambda t: t.__setitem__(_first(t, "0.self_attn.q_proj.lora_A.weight"), torch.zeros(4, 64, dtype=torch.int32)),
        "floating-point",
    ),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES), ids=list(TENSOR_CASES))
def test_bad_weights_are_refused(engine, bad_adapter, case):
    edit, message = TENSOR_CASES[case]
    _edit_tensors(bad_adapter, edit)
    _assert_refused(engine, bad_adapter, message)


def test_broken_files_are_refused(engine, bad_adapter, tmp_path):
    (bad_adapter / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    _assert_refused(engine, bad_adapter, "not a valid safetensors file")
    (bad_adapter / "adapter_config.json").write_text("{not json")
    _assert_refused(engine, bad_adapter, "not valid JSON")
    (bad_adapter / "adapter_config.json").unlink()
    _assert_refused(engine, bad_adapter, "has no adapter_config.json")
    _assert_refused(engine, tmp_path / "nowhere", "is not a directory")


def test_bin_adapter_is_read_without_unpickling_code(engine, tiny_model, tiny_adapters, tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    shutil.copy(tiny_adapters["r4-qv"] / "adapter_config.json", path)
    tensors = load_file(tiny_adapters["r4-qv"] / "adapter_model.safetensors")
    torch.save(tensors, path / "adapter_model.bin")
    engine.register_adapter("from-bin", path)
    prompt = [1, 5, 9, 33]
    [result] = engine.generate(
        [
            GenerateRequest(
                prompt_ids=prompt,
                adapter="from-bin",
                sampling=SamplingParams(max_new_tokens=6, ignore_eos=True),
            )
        ]
    )
    assert result.token_ids == hf_greedy(tiny_model, tiny_adapters["r4-qv"], prompt, 6)
    engine.adapters.unregister("from-bin")

    class Exploit:
        def __reduce__(self):
            return (print, ("pwned",))

    buffer = io.BytesIO()
    pickle.dump({"x": Exploit()}, buffer)
    (path / "adapter_model.bin").write_bytes(buffer.getvalue())
    _assert_refused(engine, path, "weights_only")


def test_adapter_from_bytes_matches_directory(engine, tiny_adapters):
    source = tiny_adapters["r8-kod-layer1"]
    key = engine.register_adapter(
        "bytes",
        config_json=(source / "adapter_config.json").read_bytes(),
        weights=memoryview((source / "adapter_model.safetensors").read_bytes()),
    )
    adapter = engine.registry.get(key)
    assert adapter.rank == 8 and adapter.layers == (1,) and adapter.modules == ("k_proj", "o_proj", "down_proj")
    engine.adapters.unregister("bytes")
