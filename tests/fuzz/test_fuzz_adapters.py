"""Fuzzers: whatever arrives as an adapter, load_adapter_bytes returns an adapter or raises
InvalidAdapterError (INVALID_ARGUMENT) — never another exception type, never a hang.

Two targets, each seeded with a real PEFT adapter of the tiny model so that mutations reach deep
into validation: the weights file (safetensors: header length u64::MAX or off by some, offsets
overlapping or out of range, bad dtypes and shapes, duplicate keys, truncated data, random
bytes; torch .bin: truncated or random bytes) and adapter_config.json (every field replaced by
random JSON of any type, regexes included, or random text).

The default budget is small for CI (LORASERVE_FUZZ_EXAMPLES, default 150 examples per test, a few
seconds each). For a longer run:

    LORASERVE_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q tests/fuzz/test_fuzz_adapters.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from loraserve.adapter_config import CONFIG_FILE
from loraserve.adapter_format import SAFETENSORS_FILE
from loraserve.errors import InvalidAdapterError
from loraserve.model_config import ModelConfig
from loraserve.worker.adapters import load_adapter_bytes

EXAMPLES = int(os.environ.get("LORASERVE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=5000,  # ms per example: validation of a tiny adapter takes a few; a hang takes forever
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
pytestmark = pytest.mark.timeout(max(300, EXAMPLES))

U64_MAX = 2**64 - 1
SAVEABLE_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
]
DTYPES = ["F16", "BF16", "F32", "F64", "I8", "I16", "I32", "I64", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "C64", "F4"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(2**80), 2**80) | st.floats() | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=12,
)
regexes = st.text(alphabet="qvkop_rj.*+?|()[]{}^$\\d1,=!<>:", max_size=40)
module_names = st.sampled_from(["q_proj", "v_proj", "k_proj", "lm_head", "model.layers.0.self_attn.q_proj", "x"])
falsy = st.sampled_from([False, None, [], {}, 0, ""])
huge_ints = st.integers(10**300, 10**4000) | st.integers(-(2**1100), 2**1100)
# Per field: values near the valid ones (so validation gets past the field and on to the next
# check) mixed with random JSON of any type.
FIELDS = {
    "peft_type": st.sampled_from(["LORA", "lora", "LoRA", "PREFIX_TUNING"]),
    "r": st.integers(-2, 70) | huge_ints,
    "lora_alpha": st.floats() | huge_ints,
    "target_modules": regexes | st.lists(module_names | regexes, max_size=3) | st.just("all-linear"),
    "layers_to_transform": st.integers(-2, 4) | st.lists(st.integers(-2, 4) | json_values, max_size=3),
    "layers_pattern": st.sampled_from([None, "layers", ["layers"], "h"]),
    "bias": st.sampled_from(["none", "all", "lora_only"]),
    "use_rslora": st.booleans(),
    **dict.fromkeys(
        [
            "use_dora",
            "modules_to_save",
            "rank_pattern",
            "alpha_pattern",
            "exclude_modules",
            "fan_in_fan_out",
            "target_parameters",
            "lora_bias",
            "layer_replication",
        ],
        falsy,
    ),
}


class Seed:
    """A valid adapter's two files, taken apart for mutation."""

    def __init__(self, adapter_dir: Path):
        self.config = json.loads((adapter_dir / CONFIG_FILE).read_text())
        raw = (adapter_dir / SAFETENSORS_FILE).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        self.header: dict = json.loads(raw[8 : 8 + n])
        self.data = raw[8 + n :]
        self.raw = raw
        self.tensors = load_safetensors(raw)


@pytest.fixture(scope="module")
def seed(tiny_adapters) -> Seed:
    return Seed(tiny_adapters["r4-qv"])


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model)


def _accepts_or_refuses(config: bytes | str, weights: bytes, model: ModelConfig, fmt: str = "safetensors") -> None:
    """The property: an adapter, or InvalidAdapterError; any other exception fails the test."""
    with contextlib.suppress(InvalidAdapterError):
        load_adapter_bytes(config, weights, model, max_rank=64, weights_format=fmt)


# ---- safetensors -----------------------------------------------------------------------------
def _mutate_entry(draw, entry: dict, data_len: int) -> dict:
    entry = dict(entry)
    choice = draw(st.sampled_from(["dtype", "shape", "offsets", "overlap", "drop", "none"]))
    if choice == "dtype":
        entry["dtype"] = draw(st.sampled_from(DTYPES) | st.text(max_size=6) | json_values)
    elif choice == "shape":
        entry["shape"] = draw(st.lists(st.integers(-3, 2**64), max_size=4) | json_values)
    elif choice == "offsets":
        bound = st.integers(-2, data_len + 64) | st.just(U64_MAX) | st.integers(0, 2**70)
        entry["data_offsets"] = draw(st.lists(bound, min_size=0, max_size=3) | json_values)
    elif choice == "overlap":
        begin = draw(st.integers(0, max(0, data_len - 4)))
        entry["data_offsets"] = [begin, draw(st.integers(begin, data_len))]
    elif choice == "drop":
        entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])))
    return entry


def _header_text(draw, header: dict) -> str:
    """The header as JSON text, sometimes with a key written twice (JSON allows it; a parser picks one)."""
    text = json.dumps(header)
    names = [k for k in header if k != "__metadata__"]
    if names and draw(st.booleans()):
        name = draw(st.sampled_from(names))
        text = text[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}" + "}"
    return text


def _mutate_contents(draw, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A well-formed file whose tensors are wrong: another dtype, a reshaped or empty tensor,
    values scaled to huge, infinite or NaN."""
    tensors = dict(tensors)
    name = draw(st.sampled_from(sorted(tensors)))
    t = tensors[name]
    change = draw(st.sampled_from(["dtype", "shape", "scale", "poke"]))
    if change == "dtype":
        dtype = draw(st.sampled_from(SAVEABLE_DTYPES))
        tensors[name] = t.to(dtype) if dtype is not torch.bool else t > 0
    elif change == "shape":
        tensors[name] = draw(st.sampled_from([t.T.contiguous(), t.flatten(), t[:0], t[:, :1].contiguous(), t[None]]))
    elif change == "scale":
        factor = draw(st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e3, 1e19, 1e38]))
        tensors = {k: v * factor for k, v in tensors.items()} if draw(st.booleans()) else {**tensors, name: t * factor}
    else:
        value = draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
        poked = t.clone()
        poked.view(-1)[draw(st.integers(0, t.numel() - 1))] = value
        tensors[name] = poked
    return tensors


@st.composite
def safetensors_files(draw, seed: Seed) -> bytes:
    kinds = ["entries", "header_length", "truncated", "random", "junk_header", "contents"]
    kind = draw(st.sampled_from(kinds))
    if kind == "contents":
        return save_safetensors(_mutate_contents(draw, seed.tensors))
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "truncated":
        return seed.raw[: draw(st.integers(0, len(seed.raw) - 1))]
    header = dict(seed.header)
    if kind == "junk_header":
        text = json.dumps(draw(json_values))
    else:
        for name in draw(st.lists(st.sampled_from(sorted(header)), max_size=4, unique=True)):
            if isinstance(header[name], dict) and name != "__metadata__":
                header[name] = _mutate_entry(draw, header[name], len(seed.data))
            else:
                header[name] = draw(json_values)
        if draw(st.booleans()):
            header[draw(st.text(max_size=60))] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        text = _header_text(draw, header)
    body = text.encode()
    length = len(body)
    if kind == "header_length":
        length = draw(st.sampled_from([U64_MAX, 2**63, len(body) + 1, len(body) - 1, 0]) | st.integers(0, U64_MAX))
    data = seed.data if draw(st.booleans()) else seed.data[: draw(st.integers(0, len(seed.data)))]
    return struct.pack("<Q", length) + body + data


@FUZZ
@given(data=st.data())
def test_any_safetensors_file_is_accepted_or_refused(seed: Seed, model: ModelConfig, data):
    weights = data.draw(safetensors_files(seed))
    _accepts_or_refuses(json.dumps(seed.config), weights, model)


@FUZZ
@given(data=st.data())
def test_any_bin_file_is_accepted_or_refused(seed: Seed, model: ModelConfig, data):
    """torch.load(weights_only=True) on a truncated, bit-flipped or random file."""
    buffer = io.BytesIO()
    torch.save({k: v.clone() for k, v in seed.tensors.items()}, buffer)
    raw = buffer.getvalue()
    kind = data.draw(st.sampled_from(["truncated", "flipped", "random"]))
    if kind == "truncated":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flipped":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]
    else:
        raw = data.draw(st.binary(max_size=512))
    _accepts_or_refuses(json.dumps(seed.config), raw, model, fmt="bin")


# ---- adapter_config.json ---------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_any_config_is_accepted_or_refused(seed: Seed, model: ModelConfig, data):
    config = dict(seed.config)
    for field in data.draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True)):
        if data.draw(st.integers(0, 9)) == 0:
            config.pop(field, None)
        else:
            config[field] = data.draw(FIELDS[field] | json_values)
    _accepts_or_refuses(json.dumps(config), seed.raw, model)


nested = st.tuples(st.integers(1, 200_000), st.sampled_from(["[]", '{"r":}'])).map(
    lambda n_pair: n_pair[1][:-1] * n_pair[0] + "1" + n_pair[1][-1] * n_pair[0]
)  # [[[1]]] or {"r":{"r":1}}, up to 200,000 deep


@FUZZ
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(bytes.hex) | json_values.map(json.dumps) | nested)
def test_any_config_text_is_accepted_or_refused(seed: Seed, model: ModelConfig, text: str):
    _accepts_or_refuses(text, seed.raw, model)
    _accepts_or_refuses(text.encode("utf-8", "surrogatepass"), seed.raw, model)
