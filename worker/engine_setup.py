"""How an `Engine` sizes its pool and builds its model runner, from its config and the model.

Pure functions of the configuration, the model and the device, called once by `Engine.__init__`:

    pages = pool_pages(config, model_config, dtype, device)
    runner, warm_up_s = model_runner(config, model, pool, layout, model_config, max_model_len, device)
    read = base_bytes(model_dir, model_config, dtype)
    check_prompt(token_ids, sampling, generated, model_config, max_model_len, layout)   # per request
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.errors import InvalidConfigError, InvalidRequestError, ResourceExhaustedError
from loraserve.kernels.backend import KernelBackend, select_backend
from loraserve.model_config import ModelConfig
from loraserve.partition import Shard, check_partition
from loraserve.worker.config import EngineConfig
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.runner import DecodePadding, ModelRunner, step_capacity
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.tensor_parallel.leader import Leader, LeaderRunner
from loraserve.worker.unified_pool import UnifiedPool
from loraserve.worker.warm_up import warm_up
from loraserve.worker.weights import tensor_sizes

PAD_SEQUENCE = object()  # owns the KV page padded decode steps write to (no request id can equal it)


def start_ranks(
    config: EngineConfig, model_dir: Path, model: ModelConfig, device: torch.device
) -> tuple[Shard, Leader | None]:
    """This process's part of the model, and with tensor parallelism the other ranks, started (it is rank 0).
    InvalidConfigError when the model cannot be split so."""
    shard = Shard(config.tensor_parallel)
    if shard.size == 1:
        return shard, None
    check_partition(model, shard.size)
    return shard, Leader.start(model_dir, config, device)


def pool_pages(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Pages of the unified pool: `pool_pages`, or as many as the memory budget holds (on CUDA: the free
    memory less what `gpu_memory_utilization` keeps back and room for a full step's activations)."""
    if config.pool_pages is not None:
        return config.pool_pages
    page_bytes = model.num_layers * config.rows_per_page * model.kv_width * dtype.itemsize
    if config.pool_memory_gb is not None:
        budget = config.pool_memory_gb * 2**30
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        activations = config.max_batched_tokens * (6 * model.hidden_size + 3 * model.intermediate_size) * 4
        logits = config.max_batch_size * model.vocab_size * 8
        budget = free - (1 - config.gpu_memory_utilization) * total - 2 * (activations + logits)
    else:
        budget = config.cpu_pool_memory_gb * 2**30
    pages = int(budget // page_bytes)
    if pages < 1:
        raise ResourceExhaustedError(f"no memory left for the page pool ({budget / 2**20:.0f} MiB available)")
    return pages


def graph_mode(config: EngineConfig, backend: KernelBackend, device: torch.device) -> str | None:
    """The decode graphs' mode (`worker.decode_graphs`), or None for none, from `cuda_graphs`."""
    mode = config.cuda_graphs
    if mode == "off":
        return None
    if backend.prepare_lora_graph is None:
        if mode == "uncaptured":
            raise InvalidConfigError(
                f"engine config cuda_graphs='uncaptured' needs the triton kernel backend, not {backend.name}"
            )
        return None
    if mode == "auto":
        return "capture" if device.type == "cuda" else None
    return mode


def backend_name(config: EngineConfig) -> str:
    """The kernel backend configured; a model split over ranks runs the torch one (its collectives sit
    between the LoRA shrink and expand, `worker/tensor_parallel/collectives.py`)."""
    return "torch" if config.tensor_parallel > 1 and config.backend == "auto" else config.backend


def adapter_dtype(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The adapters' precision the pool applies (`adapter_precision.py`): half rows need a float32 pool read by
    the torch kernel backend on one rank, so elsewhere `auto` holds every adapter at the pool's dtype, and an
    explicit half type is refused."""
    backend = backend_name(config)
    backend = ("triton" if device.type == "cuda" else "torch") if backend == "auto" else backend
    if config.adapter_dtype == "pool" or (dtype == torch.float32 and backend == "torch"):
        return config.adapter_dtype  # the config refused a split model and the emulated runner
    if config.adapter_dtype == "auto":
        return "pool"
    raise InvalidConfigError(
        f"engine config adapter_dtype={config.adapter_dtype!r}: half-precision adapter rows are for a float32 pool "
        f"read by the torch kernel backend; this pool is {str(dtype).removeprefix('torch.')} with the {backend} "
        "backend: leave --adapter-dtype auto (a half-precision pool holds adapters at half precision already)"
    )


def model_runner(
    config: EngineConfig,
    model: torch.nn.Module,
    pool: UnifiedPool,
    layout: PoolLayout,
    model_config: ModelConfig,
    max_model_len: int,
    device: torch.device,
    leader: Leader | None = None,
) -> tuple[ModelRunner, float | None]:
    """The runner of the real model — kernels chosen, decode graphs captured and warmed up as configured —
    and the seconds the warm-up took (None without one). `leader`: rank 0 of a tensor-parallel worker, whose
    runner sends each step to the other ranks (told here to build theirs)."""
    backend = select_backend(backend_name(config), device)
    capacity = step_capacity(config, layout, model_config, max_model_len)
    graphs = graph_mode(config, backend, device)
    if config.compile_model and device.type != "cpu":
        raise InvalidConfigError(f"engine config compile_model=True: --compile is for the CPU, the device is {device}")
    warm = config.warm_up == "on" or (config.warm_up == "auto" and (device.type == "cuda" or config.compile_model))
    # The scratch page: padded decode steps' pads and the warm-up's dummy steps write there.
    scratch = pool.reserve_kv_page(PAD_SEQUENCE) if config.pad_decode_steps or graphs or warm else None
    padding = DecodePadding(tuple(config.decode_buckets()), scratch) if config.pad_decode_steps or graphs else None
    if leader is None:
        runner = ModelRunner(model, pool.tensor, layout, backend, capacity, padding, compiled=config.compile_model)
    else:
        runner = LeaderRunner(model, pool.tensor, layout, backend, capacity, padding, leader=leader, copier=pool.copier)
        leader.ready(layout.num_pages, scratch)
    warm_up_s = None
    if warm:
        warm_up_s = warm_up(runner, scratch, config.max_lora_rank, graphs)
    elif graphs is not None:
        runner.capture_decode_graphs(graphs, config.max_lora_rank)
    return runner, warm_up_s


def base_bytes(model_dir: Path, config: ModelConfig, dtype: torch.dtype) -> int:
    """The base model's weights a step reads (embeddings aside, unless tied to the output layer), from the
    checkpoint's headers: the tensors `load_model` keeps, at the engine's dtype."""
    tied = config.tie_word_embeddings
    sizes = (
        (name, n)
        for name, n in tensor_sizes(model_dir)
        if not name.endswith("rotary_emb.inv_freq") and not (tied and name == "lm_head.weight")
    )
    return dtype.itemsize * sum(n for name, n in sizes if "embed_tokens" not in name or tied)


def check_prompt(
    token_ids: list[int],
    sampling: SamplingParams,
    generated: int,
    model: ModelConfig,
    max_model_len: int,
    layout: PoolLayout,
) -> None:
    """Refuse a request the engine can never run. `token_ids`: the prompt, then the `generated` tokens
    of an earlier attempt. Raises InvalidRequestError / ResourceExhaustedError."""
    if len(token_ids) == generated:
        raise InvalidRequestError("prompt", "is empty: give at least one token")
    vocab = model.vocab_size
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError("prompt_ids", f"token id {bad!r} is outside the vocabulary [0, {vocab})")
    if generated >= sampling.max_new_tokens:
        raise InvalidRequestError(
            "output_ids", f"{generated} tokens already generated; max_new_tokens is {sampling.max_new_tokens}"
        )
    prompt = len(token_ids) - generated
    total = prompt + sampling.max_new_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            "max_new_tokens",
            f"prompt ({prompt} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
            f"exceeds the model's context length {max_model_len}",
        )
    pages = layout.kv_pages_for(total)
    if pages > layout.num_pages:
        raise ResourceExhaustedError(
            f"this request needs {pages} KV pages but the whole pool has {layout.num_pages}; "
            "lower max_new_tokens or shorten the prompt"
        )
