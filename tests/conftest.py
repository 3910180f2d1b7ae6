"""Shared fixtures. Sets TRITON_INTERPRET=1 on machines without CUDA, before anything imports triton.

Tests that run Triton kernels take `kernel_device`: "cpu" (interpreted) without CUDA, "cuda"
(compiled, marked `gpu`) with it; see helpers.KERNEL_DEVICES.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests import their helpers as `helpers`

import pytest
from helpers import KERNEL_DEVICES, TinySpec, make_adapter, make_model

torch.set_num_threads(min(4, os.cpu_count() or 1))


@pytest.fixture(scope="module", params=KERNEL_DEVICES)
def kernel_device(request) -> str:
    """The device a test runs Triton kernels on: cpu under the interpreter, or cuda (the `gpu` suite)."""
    return request.param


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama with grouped-query attention and an MLP width not a multiple of the KV width."""
    return make_model(tmp_path_factory.mktemp("tiny") / "model", TinySpec())


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path, tmp_path_factory) -> dict[str, Path]:
    """Adapters of mixed ranks and targets, saved by peft: name -> directory."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "r4-qv": make_adapter(tiny_model, root / "r4-qv", 4, ["q_proj", "v_proj"], seed=1),
        "r16-all-rslora": make_adapter(tiny_model, root / "r16", 16, "all-linear", use_rslora=True, seed=2),
        "r8-kod-layer1": make_adapter(
            tiny_model, root / "r8", 8, ["k_proj", "o_proj", "down_proj"], layers_to_transform=[1], seed=3
        ),
        "r64-mlp": make_adapter(tiny_model, root / "r64", 64, ["gate_proj", "up_proj", "down_proj"], seed=4, std=0.03),
    }
