"""The Llama-family network (Llama, Mistral, Qwen2) over a flattened, ragged batch.

A step's tokens — prefill chunks and decode tokens of many requests — are concatenated into one
[T, hidden] tensor. Every projection runs once for the whole batch (x W^T), then the backend adds
the adapters' LoRA terms from the unified pool, once per group of projections that share an input
(q/k/v, o, gate/up, down: `LORA_GROUPS`), as the step's LoRA plan prepared them; attention reads
and writes KV in the pool through the step's page tables. Nothing is global: the step's metadata
arrives in `ForwardBatch`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch._opaque_base import OpaqueBase

from loraserve.errors import InvalidModelError
from loraserve.kernels.backend import KernelBackend
from loraserve.kernels.metadata import AttentionBatch, LoraPlan
from loraserve.model_config import LORA_GROUPS, LORA_MODULES, ModelConfig
from loraserve.partition import ONE_RANK, Shard, local_model
from loraserve.worker.dense import DenseLinear
from loraserve.worker.layer_progress import LayerProgress
from loraserve.worker.rope import inverse_frequencies
from loraserve.worker.tensor_parallel.sharding import shard_tensor
from loraserve.worker.weights import iter_tensors

if TYPE_CHECKING:
    from loraserve.worker.tensor_parallel.collectives import Collectives

log = logging.getLogger(__name__)


class StepOps(Protocol):
    """What the model asks of its step: `ForwardBatch` eagerly, `compiled_forward.TracedStep` compiled."""

    positions: torch.Tensor  # int64 [T]

    def add_lora(self, layer: int, group: int, x: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None: ...

    def add_lora_and_reduce(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, scale: float
    ) -> torch.Tensor: ...


@dataclass
class ForwardBatch(OpaqueBase):
    """Everything a forward pass needs besides the token ids (an `OpaqueBase`: a compiled graph and its custom
    operators take it as an opaque reference, `worker/compiled_forward.py`)."""

    positions: torch.Tensor  # int64 [T]
    attention: AttentionBatch
    lora: LoraPlan | None  # None when no token of the step uses an adapter
    pool: torch.Tensor  # [L, rows, W]: the unified pool
    backend: KernelBackend
    copies: tuple[LayerProgress, ...] = ()  # adapters of the step still being copied in, layer by layer
    tp: Collectives | None = None  # one rank of a tensor-parallel worker: its communication (None: one rank)

    def add_lora(self, layer: int, group: int, x: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
        """outputs[i] += the LoRA term of module LORA_GROUPS[group][i] on input x, for every adapter token;
        first waits for the layer's rows of every adapter still being copied (`worker/layer_progress.py`)."""
        for copy in self.copies:
            copy.wait_layer(layer)
        if self.lora is not None:
            apply = self.backend.lora_apply if self.tp is None else self.tp.lora_apply
            apply(outputs, x, self.pool[layer], self.lora, layer, group)

    def add_lora_and_reduce(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output y: its LoRA term added, then (tensor-parallel) summed over the
        ranks, each rank having added its columns of the LoRA term to its partial sum (`loraserve/partition.py`)."""
        if self.tp is None:
            self.add_lora(layer, group, x, (y,))
            return y
        self.add_lora(layer, group, x, (y[:, self.tp.hidden_part(y.shape[1])],))
        return self.tp.all_reduce(y)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, scale: float
    ) -> torch.Tensor:
        """The new tokens' k [T, kv_heads * D] and v written to the pool, then their queries q [T, H, D]
        attended over their sequences' keys: [T, H, D]."""
        pool_layer = self.pool[layer]
        self.backend.write_kv(pool_layer, k, v, self.attention)
        return self.backend.attention(q, pool_layer, self.attention, kv_heads, scale)


# Index of each projection group in LORA_GROUPS, as the model applies them.
QKV, O_PROJ, GATE_UP, DOWN = range(4)
assert [tuple(LORA_MODULES[m] for m in g) for g in LORA_GROUPS] == [
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Projection(nn.Module):
    """A projection's checkpoint tensors, under their Hugging Face names, until `pack` fuses them into the
    `DenseLinear` the forward pass runs (`worker/dense.py`)."""

    def __init__(self, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(d_out), requires_grad=False) if bias else None


def pack(module: nn.Module, names: tuple[str, ...]) -> DenseLinear:
    """One DenseLinear for `module`'s projections `names` (which share an input); they are removed."""
    projections = [module._modules.pop(name) for name in names]
    return DenseLinear([p.weight for p in projections], [p.bias for p in projections])


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary embedding, x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1],
    written as x * cos + [x2, x1] * [-sin1, sin2] (`sin_signed`): the same products and sums, bit for bit,
    in four operations. x: [T, heads, D]; cos, sin_signed: [T, 1, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.layer = layer
        self.q_proj = Projection(c.hidden_size, c.q_width, c.qkv_bias)
        self.k_proj = Projection(c.hidden_size, c.kv_width, c.qkv_bias)
        self.v_proj = Projection(c.hidden_size, c.kv_width, c.qkv_bias)
        self.o_proj = Projection(c.q_width, c.hidden_size, c.o_bias)

    def pack(self) -> None:
        self.qkv, self.o = pack(self, ("q_proj", "k_proj", "v_proj")), pack(self, ("o_proj",))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepOps) -> torch.Tensor:
        t, heads = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv.fused(x)  # [T, q | k | v]
        q, k, v = qkv.split(self.qkv.widths, dim=-1)
        batch.add_lora(self.layer, QKV, x, (q, k, v))  # into qkv's columns, in place
        qk = rope(qkv[:, : heads * self.head_dim].view(t, heads, self.head_dim), cos, sin)  # q and k at once
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = batch.attend(self.layer, q, k.reshape(t, -1), v, self.num_kv_heads, self.scale).reshape(t, -1)
        (y,) = self.o(out)
        return batch.add_lora_and_reduce(self.layer, O_PROJ, out, y)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.layer = layer
        self.gate_proj = Projection(h, i, bias)
        self.up_proj = Projection(h, i, bias)
        self.down_proj = Projection(i, h, bias)

    def pack(self) -> None:
        self.gate_up, self.down = pack(self, ("gate_proj", "up_proj")), pack(self, ("down_proj",))

    def forward(self, x: torch.Tensor, batch: StepOps) -> torch.Tensor:
        gate, up = self.gate_up(x)
        batch.add_lora(self.layer, GATE_UP, x, (gate, up))
        hidden = F.silu(gate) * up
        (y,) = self.down(hidden)
        return batch.add_lora_and_reduce(self.layer, DOWN, hidden, y)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepOps) -> torch.Tensor:
        """cos, sin: [T, 1, D], sin with its first half negated (`rope`)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x), batch)


class Decoder(nn.Module):
    """Parameter names match the Hugging Face checkpoint ("model.layers.0.self_attn.q_proj.weight")."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # `_weight`: no random init (on the meta device it would import torch._dynamo: seconds of start-up CPU)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """`config`: the whole model's shape; `shard`: the tensor-parallel rank whose part this is (its heads and
    MLP share, `loraserve/partition.py`; `self.config` is that part's shape)."""

    def __init__(self, config: ModelConfig, shard: Shard = ONE_RANK):
        super().__init__()
        self.full_config, self.shard = config, shard
        self.config = config = local_model(config, shard)
        self.model = Decoder(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        if self.lm_head is not None:
            self.lm_head.weight.requires_grad_(False)
        with torch.device("cpu"):  # computed for real, even while the model is built on the meta device
            inv_freq = inverse_frequencies(config.rope, config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.parameter_count = 0  # the checkpoint's, set by `load_model` (packing leaves no nn.Parameter to count)

    def forward(self, input_ids: torch.Tensor, batch: StepOps) -> torch.Tensor:
        """Hidden states after the final norm. input_ids: [T] -> [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2], float32 as in HF
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        cos, sin = torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]  # see `rope`
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch)
        return self.model.norm(x)

    def pack(self) -> None:
        """Fuse the loaded projections into the GEMMs the forward pass runs (`worker/dense.py`): q/k/v, o,
        gate/up and down per layer, and an untied output layer (a tied one stays the embedding table)."""
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        self.head = None if self.lm_head is None else pack(self, ("lm_head",))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]."""
        if self.head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.head(hidden)[0].float()


def load_model(
    model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, shard: Shard = ONE_RANK
) -> CausalLM:
    """Build the network and fill it from the checkpoint's safetensors; every tensor is checked. `shard`:
    the tensor-parallel rank whose part of the network this is (`loraserve/partition.py`)."""
    with torch.device("meta"):
        full = {name: p.shape for name, p in CausalLM(config).named_parameters()}
        model = CausalLM(config, shard)
    expected = {name: p for name, p in model.named_parameters()}
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors(model_dir):
        if name not in expected:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            raise InvalidModelError(f"{model_dir}: unexpected tensor {name!r} for a {config.model_type} model")
        if tuple(tensor.shape) != tuple(full[name]):
            raise InvalidModelError(
                f"{model_dir}: tensor {name} has shape {list(tensor.shape)}, config.json implies {list(full[name])}"
            )
        loaded[name] = shard_tensor(name, tensor, config, shard).to(device=device, dtype=dtype)
        assert loaded[name].shape == expected[name].shape, name
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise InvalidModelError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    model.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(device)
    model.eval()
    model.parameter_count = sum(math.prod(shape) for shape in full.values())
    loaded.clear()  # the model holds the tensors now: packing frees each group's as it fuses them (peak: one group)
    model.pack()
    log.info(
        "loaded %s model from %s: %d layers, hidden %d, %d/%d heads, %.1fM parameters, %s on %s%s",
        config.model_type,
        model_dir,
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        model.parameter_count / 1e6,
        dtype,
        device,
        f", tensor-parallel rank {shard.index} of {shard.size}" if shard.size > 1 else "",
    )
    return model
