"""The model's forward pass compiled by inductor, on the CPU (`--compile`).

Between the GEMMs a layer runs some forty small torch operators — the norms, the rotary embedding,
SiLU·mul, the residual adds — each a dispatch and a pass over memory. Compiled, they are fused into a
few C++ loops and the step calls one graph. What depends on the step stays opaque to the compiler, as
two custom operators (`torch.library`):

    loraserve::add_lora(outputs, x, layer, group, batch)   outputs[i] += LoRA term (the backend's, in place)
    loraserve::attend(q, k, v, layer, kv_heads, scale, batch) -> out    KV written, then paged attention

`batch` is the step's `ForwardBatch`, passed to the graph and the operators as an opaque reference
object (`torch._library.opaque_object`): no step value is baked into the graph and no global carries it.
The LoRA plan, the page tables and the pool are read by the operators at run time, so compilation stays
on with adapters, whatever their ranks and mix.

Shapes are dynamic in the step's token count T. There are two graphs, one for steps with adapters and
one without (which skips the LoRA calls); both are compiled by the engine's warm-up before it serves.
A step of one token runs eagerly (a graph for T = 1, which torch specializes, would be a third compile
for the case where fusing saves least). The GEMMs stay oneDNN's over the weights `DenseLinear`
reordered at load: inductor's own lowering of `mkldnn._linear_pointwise` expects weights it froze and
reordered itself, so in this process that operator is lowered as a plain call (`_call_linear_as_is`).
Inductor caches compiled graphs on disk (`TORCHINDUCTOR_CACHE_DIR`), so a restart recompiles quickly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch._library.opaque_object import register_opaque_type

from loraserve.worker.model import CausalLM, ForwardBatch

log = logging.getLogger(__name__)

register_opaque_type(ForwardBatch, typ="reference", hoist=True)


@torch.library.custom_op("loraserve::add_lora", mutates_args=("outputs",))
def add_lora(outputs: list[torch.Tensor], x: torch.Tensor, layer: int, group: int, batch: ForwardBatch) -> None:
    batch.add_lora(layer, group, x, tuple(outputs))


@torch.library.custom_op("loraserve::attend", mutates_args=())
def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, kv_heads: int, scale: float, batch: ForwardBatch
) -> torch.Tensor:
    return batch.attend(layer, q, k, v, kv_heads, scale).contiguous()


@attend.register_fake
def _(q, k, v, layer, kv_heads, scale, batch):
    return q.new_empty(q.shape)


class TracedStep:
    """What the model calls on its batch (`model.StepOps`), as the compiled graph sees it: the custom operators
    over the step's `ForwardBatch`; `lora`: whether the step has adapter work (else the LoRA calls vanish)."""

    def __init__(self, batch: ForwardBatch, positions: torch.Tensor, lora: bool):
        self.batch, self.positions, self.lora = batch, positions, lora

    def add_lora(self, layer: int, group: int, x: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
        if self.lora:
            torch.ops.loraserve.add_lora(list(outputs), x, layer, group, self.batch)

    def add_lora_and_reduce(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.add_lora(layer, group, x, (y,))
        return y

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, scale: float
    ) -> torch.Tensor:
        return torch.ops.loraserve.attend(q, k, v, layer, kv_heads, scale, self.batch)


class CompiledForward:
    """`model(input_ids, batch)` through the compiled graphs (steps of two tokens or more, on one rank)."""

    def __init__(self, model: CausalLM):
        _call_linear_as_is()
        self.model = model
        self.graph = torch.compile(self._traced, dynamic=True, fullgraph=True)

    def _traced(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, lora: bool):
        return self.model(input_ids, TracedStep(batch, positions, lora))

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if input_ids.shape[0] < 2:
            return self.model(input_ids, batch)
        return self.graph(input_ids, batch.positions, batch, batch.lora is not None or bool(batch.copies))


@functools.cache
def _call_linear_as_is() -> None:
    """Lower `mkldnn._linear_pointwise` as calls of the operator on the weight it is given (see the module
    docstring); once per process."""
    from torch._inductor import lowering

    packet = torch.ops.mkldnn._linear_pointwise  # alone, and fused with the add that follows it (binary)
    torch.library.register_fake(packet.binary)(lambda x, other, w, b, attr: other.new_empty(other.shape))
    for name in packet.overloads():
        lowering.lowerings.pop(getattr(packet, name), None)
        lowering.make_fallback(getattr(packet, name))
    log.info("inductor: mkldnn._linear_pointwise lowered as calls (weights reordered at load)")
