"""The kernel backend: chosen once from configuration, logged, then passed to the model.

Both backends implement the same operations with the same semantics (see each module's
docstring); the torch one is the reference and what runs on CPU. LoRA is planned once per step
(`prepare_lora`, from the step's `LoraPlan`) and then applied per layer and projection group
(`lora_apply`), which only launches kernels or multiplies. Only the Triton backend can be captured
in a CUDA graph: its launches can be made independent of the step (`prepare_lora_graph`), where the
torch path's bucketing is host work from each step's values.

The Triton backend's kernels are imported only when it is chosen: on CUDA they are compiled; on CPU
they run only under Triton's interpreter, which must be switched on (TRITON_INTERPRET=1) before triton
is first imported: it is chosen when `@triton.jit` decorates each kernel, so setting it later has no
effect.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraserve.kernels.attention_torch import attention_torch, write_kv_torch
from loraserve.kernels.lora_bmm import lora_apply_bmm, prepare_lora_bmm
from loraserve.kernels.lora_torch import lora_apply_torch, prepare_lora_torch
from loraserve.kernels.metadata import AttentionBatch, LoraPlan

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton", "torch-bmm")  # torch-bmm: the padded baseline, for benchmarks

PrepareLora = Callable[[LoraPlan, torch.dtype], object]
PrepareLoraGraph = Callable[[LoraPlan, torch.dtype, int], object]
LoraApply = Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor, LoraPlan, int, int], None]
WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch], None]
Attend = Callable[[torch.Tensor, torch.Tensor, AttentionBatch, int, float], torch.Tensor]


@dataclass(frozen=True)
class KernelBackend:
    name: str
    prepare_lora: PrepareLora  # (plan, dtype) -> the backend's per-step work, stored as plan.prepared
    lora_apply: LoraApply  # (outputs, x, pool_layer, plan, layer, group) -> None, outputs updated in place
    write_kv: WriteKV  # (pool_layer, k, v, attention_batch) -> None
    attention: Attend  # (q, pool_layer, attention_batch, num_kv_heads, scale) -> out
    # (graph plan, dtype, max_rank) -> what a captured decode step launches (`kernels.graph_tables`);
    # None: the backend's launches depend on each step's host values, so it cannot be captured.
    prepare_lora_graph: PrepareLoraGraph | None = None


TORCH = KernelBackend("torch", prepare_lora_torch, lora_apply_torch, write_kv_torch, attention_torch)
TORCH_BMM = KernelBackend("torch-bmm", prepare_lora_bmm, lora_apply_bmm, write_kv_torch, attention_torch)


def select_backend(name: str, device: torch.device) -> KernelBackend:
    """`auto` is triton on CUDA and torch elsewhere. Triton on CPU needs TRITON_INTERPRET=1."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        backend = TORCH
    elif name == "torch-bmm":
        backend = TORCH_BMM
    else:
        backend = triton_backend(device)
    log.info("kernel backend: %s on %s", backend.name, device)
    return backend


def triton_backend(device: torch.device | str) -> KernelBackend:
    """The Triton kernels (`lora_triton`, `attention_triton`) as a KernelBackend for `device`."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"the triton kernel backend runs on cuda (or cpu, interpreted), not on {device}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton on CPU needs TRITON_INTERPRET=1 set before triton is imported; "
            "set it in the environment, or use the torch kernel backend"
        )
    try:
        from loraserve.kernels.attention_triton import attention_triton, write_kv_triton
        from loraserve.kernels.lora_triton import (
            _shrink_token_kernel,
            lora_apply_triton_group,
            prepare_lora_triton,
            prepare_lora_triton_graph,
        )
    except ImportError as e:
        raise RuntimeError(f"the triton kernel backend needs the triton package: {e}") from e
    if device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(_shrink_token_kernel, InterpretedFunction):
            raise RuntimeError(
                "triton on CPU needs TRITON_INTERPRET=1 set before triton is imported; the kernels were "
                "compiled for the GPU because triton was imported before it was set"
            )
    return KernelBackend(
        "triton",
        prepare_lora_triton,
        lora_apply_triton_group,
        write_kv_triton,
        attention_triton,
        prepare_lora_graph=prepare_lora_triton_graph,
    )
