"""Adapters held at half precision in a float32 pool (`--adapter-dtype`, `worker/adapter_precision.py`)
against transformers + peft.

`bfloat16` rounds float32 adapters: the engine must then compute exactly what PEFT computes with the same
adapters rounded to bfloat16 (greedy tokens identical, first-step logits within the float32 tolerance of
`test_engine_parity`). `auto` keeps an adapter saved in bfloat16 so, which is exact: the same tokens as PEFT
with that adapter. Either way such an adapter takes half the pages, and its rows in the pool (read through
`rows_view`) are its weights at half precision.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy
from safetensors.torch import load_file, save_file
from test_engine_parity import GREEDY, PROMPTS, _engine, check_first_step_logits

from loraserve.errors import InvalidConfigError
from loraserve.kernels.batch import rows_view
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import GenerateRequest

NEW_TOKENS = GREEDY.max_new_tokens


def _rounded(adapter: Path, out: Path, dtype: torch.dtype) -> Path:
    """A copy of a PEFT adapter directory with its weights saved in `dtype`."""
    out.mkdir(parents=True)
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({name: t.to(dtype) for name, t in weights.items()}, out / "adapter_model.safetensors")
    return out


@pytest.fixture(scope="module")
def bf16_adapters(tiny_adapters, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16-adapters")
    return {name: _rounded(path, root / name, torch.bfloat16) for name, path in tiny_adapters.items()}


def _requests(names) -> list[GenerateRequest]:
    adapters = [None, *names]
    return [GenerateRequest(prompt_ids=p, adapter=a, sampling=GREEDY) for p, a in zip(PROMPTS, adapters, strict=True)]


def _peft_tokens(model, adapters, requests) -> list[list[int]]:
    return [hf_greedy(model, adapters.get(r.adapter), r.prompt_ids, NEW_TOKENS) for r in requests]


@pytest.fixture(scope="module")
def bf16_oracle(tiny_model, bf16_adapters) -> list[list[int]]:
    """PEFT's greedy tokens with the bfloat16 adapters (loaded into the float32 model: widened exactly)."""
    return _peft_tokens(tiny_model, bf16_adapters, _requests(bf16_adapters))


def _pages_and_rows(engine, adapters: dict[str, Path]) -> dict[str, tuple[int, torch.dtype | None]]:
    """Each adapter's pages in the pool and its rows' dtype, after checking the rows hold its weights."""
    seen = {}
    for key, slot in engine.pool._slots.items():
        host = engine.pool.host.get(key)
        expected = host.rows(engine.layout, engine.model_config, slot.row_dtype or torch.float32)
        held = rows_view(engine.pool.tensor, slot.row_dtype).index_select(1, slot.row_index)
        assert torch.equal(held, expected), key
        seen[key[0]] = (len(slot.pages), slot.row_dtype)  # key: (name, version)
    assert set(seen) == set(adapters)
    return seen


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_rounded_adapters_compute_what_peft_computes_with_them_rounded(tiny_model, tiny_adapters, tmp_path, half):
    """float32 adapters under --adapter-dtype bfloat16 / float16: PEFT with the adapters saved in that dtype is
    the reference, token for token and in the first step's logits."""
    dtype = getattr(torch, half)
    rounded = {n: _rounded(p, tmp_path / n, dtype) for n, p in tiny_adapters.items()}
    requests = _requests(tiny_adapters)
    engine = _engine(tiny_model, tiny_adapters, adapter_dtype=half)
    results = engine.generate(requests)
    for request, result, expected in zip(requests, results, _peft_tokens(tiny_model, rounded, requests), strict=True):
        assert result.token_ids == expected, request.adapter
    held = _pages_and_rows(engine, tiny_adapters)
    assert {d for _, d in held.values()} == {dtype}
    pool_dtype = _pages_and_rows(_generated(_engine(tiny_model, tiny_adapters), requests), tiny_adapters)
    for name, (pages, _) in held.items():
        assert pages == -(-pool_dtype[name][0] // 2), name  # half the pages (rounded up)
    check_first_step_logits(_engine(tiny_model, tiny_adapters, adapter_dtype=half), tiny_model, rounded)


def _generated(engine, requests):
    engine.generate(requests)
    return engine


def test_auto_keeps_bfloat16_adapters_exactly(tiny_model, tiny_adapters, bf16_adapters, bf16_oracle):
    """Under auto, adapters saved in bfloat16 stay so in the pool and give PEFT's tokens with them; float32
    adapters stay float32 (the engine's default tokens)."""
    requests = _requests(bf16_adapters)
    engine = _engine(tiny_model, bf16_adapters, adapter_dtype="auto")
    results = engine.generate(requests)
    assert [r.token_ids for r in results] == bf16_oracle
    assert {d for _, d in _pages_and_rows(engine, bf16_adapters).values()} == {torch.bfloat16}
    mixed = {**tiny_adapters, "r16-all-rslora": bf16_adapters["r16-all-rslora"]}  # one bfloat16 among float32
    engine = _generated(_engine(tiny_model, mixed, adapter_dtype="auto"), _requests(mixed))
    held = {name: dtype for name, (_, dtype) in _pages_and_rows(engine, mixed).items()}
    assert held == {name: torch.bfloat16 if name == "r16-all-rslora" else None for name in mixed}


@pytest.mark.parametrize(("setting", "held"), [(None, torch.bfloat16), ("pool", None)], ids=["default", "pool"])
def test_the_default_is_auto_and_pool_holds_every_adapter_at_the_pool_dtype(
    tiny_model, bf16_adapters, bf16_oracle, setting, held
):
    engine = _engine(tiny_model, bf16_adapters, **({} if setting is None else {"adapter_dtype": setting}))
    assert [r.token_ids for r in engine.generate(_requests(bf16_adapters))] == bf16_oracle
    assert {d for _, d in _pages_and_rows(engine, bf16_adapters).values()} == {held}


def test_auto_holds_adapters_at_a_half_precision_pools_dtype(tiny_model, bf16_adapters):
    """Where half rows cannot be (a bfloat16 pool), auto is the pool's dtype, not an error."""
    engine = _engine(tiny_model, bf16_adapters, dtype="bfloat16")
    engine.generate(_requests(bf16_adapters))
    assert {slot.row_dtype for slot in engine.pool._slots.values()} == {None}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tensor_parallel": 2}, "split model"),
        ({"backend": "triton"}, "torch kernel backend"),
        ({"backend": "torch-bmm"}, "torch kernel backend"),
        ({"adapter_dtype": "float64"}, "choose pool, auto, bfloat16, float16"),
        ({"runner": "emulated", "runner_profile": Path("p.json")}, "emulated runner"),
    ],
)
def test_settings_that_cannot_hold_half_rows_are_refused(overrides, message):
    with pytest.raises(InvalidConfigError, match=message):
        EngineConfig(**{"adapter_dtype": "bfloat16", **overrides})


def test_a_half_precision_pool_refuses_rounding_adapters(tiny_model):
    """A bfloat16 pool holds adapters at half precision already: --adapter-dtype bfloat16 would mean nothing."""
    with pytest.raises(InvalidConfigError, match="float32 pool"):
        _engine(tiny_model, {}, adapter_dtype="bfloat16", dtype="bfloat16")
