"""The Triton kernel backend: batched LoRA and paged attention kernels (see lora_triton, attention_triton).

On CUDA the kernels are compiled; on CPU they run only under Triton's interpreter, which must be
switched on (TRITON_INTERPRET=1) before triton is first imported: it is chosen when `@triton.jit`
decorates each kernel, so setting it later has no effect.
"""

from __future__ import annotations

import os

import torch

from loraserve.kernels.backend import KernelBackend


def triton_backend(device: torch.device | str) -> KernelBackend:
    """The Triton kernels as a KernelBackend for `device`."""
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
