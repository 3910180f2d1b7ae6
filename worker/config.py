"""The worker's configuration: the engine's (`EngineConfig`, which `loraserve generate` runs alone too) and
the worker process's around it (`WorkerConfig`, its adapter fetches' `FetchConfig` nested). Frozen dataclasses
validated on construction, whose fields are the flags (`config_cli.py`); torch is imported only when a method
needs it, so `loraserve up` reads these settings without loading it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from loraserve.config_cli import directory_setting, setting
from loraserve.errors import InvalidConfigError
from loraserve.internal_auth import Curve, InternalKeys
from loraserve.model_config import DEFAULT_MAX_LORA_RANK
from loraserve.process import DRAIN_TIMEOUT_S
from loraserve.shared_defaults import (
    ADAPTER_ROWS,
    PREFETCH_DEPTH,
    SCHEDULER_WORKER_ADDRESS,
    SHARED_MEMORY_ROOT,
    STORE_DATA_ADDRESS,
)
from loraserve.wire import MAX_BATCH
from loraserve.worker.cpu_cores import StepCores, parse_cores

if TYPE_CHECKING:
    import torch

CUDA_GRAPHS = ("auto", "off", "uncaptured")
RUNNERS = ("real", "emulated")
BACKENDS = ("auto", "torch", "triton", "torch-bmm")
WARM_UP = ("auto", "on", "off")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
ADAPTER_DTYPES = ("pool", "auto", "bfloat16", "float16")  # `worker/adapter_precision.py`
GIB = 2**30


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting; each is a flag of `loraserve worker`, `generate` and `up` (`config_cli.py`)."""

    device: str = setting("auto", "auto, cpu, cuda, cuda:N")  # auto: CUDA if present, else CPU
    # Ranks the model is split over (`loraserve/partition.py`): one process each, rank 0 on `device` and the
    # others on the next CUDA devices (or all on the CPU, over gloo); `worker/tensor_parallel/`.
    tensor_parallel: int = setting(
        1, "split the model over this many ranks, one process and device each (tensor parallelism; 1: none)"
    )
    # "auto": float32 on CPU; on CUDA the checkpoint's half type, else bfloat16
    dtype: str = setting("auto", "", choices=("auto", *DTYPE_NAMES))
    backend: str = setting("auto", "kernel backend", choices=BACKENDS)  # auto: triton on CUDA, torch on CPU
    max_batch_size: int = setting(64, "running requests per step")
    max_batched_tokens: int = setting(2048, "tokens per step (prefill chunks and decodes)")
    max_model_len: int | None = setting(None, "prompt + output tokens at most (default: the model's max positions)")
    max_lora_rank: int = setting(DEFAULT_MAX_LORA_RANK, "largest LoRA rank the pool holds")
    rows_per_page: int = setting(32, "pool rows per page (a KV page then holds half as many tokens)")
    pool_pages: int | None = setting(None, "size of the unified pool in pages")
    pool_memory_gb: float | None = setting(None, "size of the unified pool in GiB")
    gpu_memory_utilization: float = setting(
        0.90, "with neither --pool-pages nor --pool-memory-gb, on CUDA: this share of the device for the pool"
    )
    cpu_pool_memory_gb: float = setting(0.5, "with neither --pool-pages nor --pool-memory-gb, on CPU: the pool's GiB")
    adapter_pool_fraction: float | None = setting(
        None, "give adapters this share of the pool and KV pages the rest (unset: one unified pool)"
    )
    # Adapter rows at half precision in a float32 pool, two to a pool row: half the bytes a step reads and the
    # pages an adapter takes (`worker/adapter_precision.py`); the torch kernel backend on one rank (`auto`
    # holds adapters at the pool's dtype elsewhere; bfloat16 and float16 are refused there).
    adapter_dtype: str = setting(
        "auto",
        "adapters' precision in a float32 pool: auto (an adapter whose weights are float16 or bfloat16 keeps them "
        "so, exactly, where the pool allows it; others float32), pool (every adapter at the pool's dtype), "
        "bfloat16 or float16 (every adapter, rounded)",
        choices=ADAPTER_DTYPES,
    )
    prefetch: bool = setting(True, "prefetch predicted adapters")
    prefix_cache: bool = setting(
        True,
        "keep full KV pages for later requests with the same prefix, adapter and tenant "
        "(--no-prefix-cache: compute every prompt from its first token)",
    )
    prefetch_depth: int = setting(PREFETCH_DEPTH, "waiting requests looked at when predicting adapters")
    prefetch_reserve: float = setting(0.10, "share of pages prefetch leaves free for KV growth")
    seed: int = setting(0, "seeds requests that carry no seed of their own, in arrival order", flag="--engine-seed")
    adapter_cache_bytes: int | None = setting(
        None,
        "host RAM for fetched adapters, GiB; least recently used ones no request holds are evicted past it "
        "and fetched from the adapter store again when needed",
        flag="--adapter-cache-gb",
        flag_type=float,
        parse=lambda gib: int(gib * GIB),
        show=lambda n: None if n is None else n / GIB,
    )  # None: keep every adapter (an engine without an adapter store to fetch them back from)
    # Pad decode-only steps to a batch-size bucket (`decode_buckets`), the fixed shapes a CUDA graph
    # is captured at; the pads are sequences of one token on a KV page kept aside for them.
    pad_decode_steps: bool = setting(False, "pad decode-only steps to a batch-size bucket (graphs always do)")
    # Decode steps from CUDA graphs, one per bucket (`worker.decode_graphs`): "auto" captures them on
    # CUDA with the triton backend; "off" runs every step eagerly (`--enforce-eager`); "uncaptured"
    # runs the captured path's code each step without capturing it, on any device with the triton
    # backend (how a machine without a GPU checks that path). Graphs pad decode steps.
    cuda_graphs: str = setting(
        "auto",
        "decode steps from CUDA graphs: auto (on CUDA with the triton backend), off, or uncaptured (the graph "
        "path's code run without capturing, on any device with the triton backend)",
        choices=CUDA_GRAPHS,
        switch=(
            "--enforce-eager",
            "off",
            "no CUDA graphs: run every decode step eagerly (by default, on CUDA with the triton backend, "
            "decode steps replay a graph captured per batch-size bucket at start-up)",
        ),
    )
    # Compile every kernel variant, and capture the graphs, before serving: "auto" does on CUDA.
    warm_up: str = setting(
        "auto", "compile every kernel variant (and capture the graphs) before serving; auto: on CUDA", choices=WARM_UP
    )
    # "real" runs the model; "emulated" (a benchmark and test tool, `worker/emulated/runner.py`) loads
    # no weights and waits each step's time as `runner_profile` predicts, on the CPU, with
    # deterministic tokens; kernels, graphs and warm-up do not apply to it.
    runner: str = setting(
        "real",
        "real: run the model; emulated: a benchmark and test tool, never for serving: no weights loaded, "
        "each step waits the time --runner-profile predicts (on the CPU, taking almost none of it) and emits "
        "deterministic tokens",
        choices=RUNNERS,
    )
    runner_profile: Path | None = setting(
        None,
        "with --runner emulated: the step-cost profile measured on the real engine "
        "(`loraserve bench --suite runner-profile --out DIR` writes DIR/runner_profile.json)",
        metavar="FILE",
    )
    # The layers compiled by inductor around the attention and LoRA operators (`worker/compiled_forward.py`):
    # on the CPU, on one rank; the warm-up compiles them before serving.
    compile_model: bool = setting(
        False,
        "compile the model's layers with inductor, attention and LoRA as custom operators (CPU, one rank; "
        "compiled at start-up, cached on disk)",
        flag="--compile",
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise InvalidConfigError(f"engine config {name}={getattr(self, name)!r}: {why}")

        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            bad("dtype", f"choose auto, {', '.join(DTYPE_NAMES)}")
        if self.backend not in BACKENDS:
            bad("backend", "choose auto, torch, triton or torch-bmm")
        if self.cuda_graphs not in CUDA_GRAPHS:
            bad("cuda_graphs", f"choose {', '.join(CUDA_GRAPHS)}")
        if self.warm_up not in WARM_UP:
            bad("warm_up", "choose auto, on or off")
        if self.adapter_pool_fraction is not None and not 0.0 < self.adapter_pool_fraction < 1.0:
            bad("adapter_pool_fraction", "must be in (0, 1), or unset for the unified pool")
        for name in ("max_batch_size", "max_batched_tokens", "max_lora_rank", "prefetch_depth"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.max_batch_size > MAX_BATCH:
            bad("max_batch_size", f"must be at most {MAX_BATCH} (what the scheduler accepts in a report)")
        if self.rows_per_page < 2 or self.rows_per_page % 2:
            bad("rows_per_page", "must be an even number >= 2")
        if self.pool_pages is not None and self.pool_pages < 1:
            bad("pool_pages", "must be >= 1")
        if self.pool_memory_gb is not None and self.pool_memory_gb <= 0:
            bad("pool_memory_gb", "must be > 0")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            bad("gpu_memory_utilization", "must be in [0.05, 0.99]")
        if not 0.0 <= self.prefetch_reserve < 1.0:
            bad("prefetch_reserve", "must be in [0, 1)")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        if self.adapter_cache_bytes is not None and self.adapter_cache_bytes < 0:
            bad("adapter_cache_bytes", "must be >= 0, or unset to keep every adapter")
        if self.runner not in RUNNERS:
            bad("runner", f"choose {' or '.join(RUNNERS)}")
        if self.runner == "emulated" and self.runner_profile is None:
            bad(
                "runner",
                "the emulated runner needs runner_profile (--runner-profile FILE): write one with `loraserve "
                "bench --suite runner-profile --model MODEL_DIR --out DIR`, then pass DIR/runner_profile.json",
            )
        if self.runner == "emulated" and self.device not in ("auto", "cpu"):
            bad("device", "the emulated runner runs on the CPU: leave device auto or cpu")
        if self.tensor_parallel < 1:
            bad("tensor_parallel", "must be >= 1")
        if self.tensor_parallel > 1 and self.runner == "emulated":
            bad("tensor_parallel", "the emulated runner has no model to split: leave it 1")
        if self.tensor_parallel > 1 and self.backend not in ("auto", "torch"):
            bad("tensor_parallel", "a split model runs the torch kernel backend: leave backend auto or torch")
        if self.compile_model and self.tensor_parallel > 1:
            bad("compile_model", "a split model runs its steps eagerly: --compile needs one rank")
        if self.compile_model and self.runner == "emulated":
            bad("compile_model", "the emulated runner has no model to compile")
        if self.compile_model and self.device.startswith("cuda"):
            bad("compile_model", "--compile is for the CPU; on CUDA decode steps replay CUDA graphs")
        if self.adapter_dtype not in ADAPTER_DTYPES:
            bad("adapter_dtype", f"choose {', '.join(ADAPTER_DTYPES)}")
        rounded = self.adapter_dtype in ("bfloat16", "float16")
        if rounded and self.tensor_parallel > 1:
            bad("adapter_dtype", "a split model holds adapters at the pool's precision: leave adapter_dtype auto")
        if rounded and self.runner == "emulated":
            bad("adapter_dtype", "the emulated runner reads no adapter rows: leave adapter_dtype auto")
        if rounded and self.backend not in ("auto", "torch"):
            bad("adapter_dtype", "half-precision adapter rows are read by the torch kernel backend: leave backend auto")
        if self.tensor_parallel > 1 and self.cuda_graphs == "uncaptured":
            bad("tensor_parallel", "a split model runs its steps eagerly: cuda_graphs uncaptured needs one rank")

    def decode_buckets(self) -> list[int]:
        """The batch sizes decode steps are padded to: 1, 2, 4, 8, then every multiple of 8, up to max_batch_size."""
        sizes = [b for b in (1, 2, 4) if b < self.max_batch_size] + list(range(8, self.max_batch_size, 8))
        return [*sizes, self.max_batch_size]

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidConfigError(f"engine config device={self.device!r}: CUDA is not available on this machine")
        return device

    def torch_dtype(self, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
        import torch

        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if self.dtype != "auto":
            return dtypes[self.dtype]
        if device.type != "cuda":
            return torch.float32
        return dtypes.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16


@dataclass(frozen=True)
class FetchConfig:
    """How a worker fetches adapters from the store (`worker/fetch_threads.py`)."""

    store_address: str = setting(STORE_DATA_ADDRESS, "the adapter store's ZMQ data address")
    fetch_timeout_s: float = setting(10.0, "seconds to wait for an adapter from the store", flag="--fetch-timeout")
    fetch_threads: int = setting(2, "threads fetching adapters from the store")
    adapter_rows: bool = setting(
        ADAPTER_ROWS,
        "fetch adapters already packed in the pool's row layout when the store has them, instead of their "
        "files to parse, validate and pack here (--no-adapter-rows: the files)",
    )
    shm_root: Path | None = directory_setting(
        SHARED_MEMORY_ROOT,
        "the store's --shared-memory-root: rows of a store on this host and user are mapped from there, "
        "not received over the socket; empty: the socket only",
        flag="--shared-memory-root",
    )
    verify_shared_memory: bool = setting(
        False,
        "hash rows mapped from shared memory against the store's digests too (rows over the socket always are)",
    )  # `loraserve/shared_memory.py` says why it is off
    curve: Curve | None = None  # CURVE client options for the store's data port

    def __post_init__(self) -> None:
        if self.fetch_timeout_s <= 0 or self.fetch_threads < 1:
            raise InvalidConfigError(
                f"fetch_timeout_s must be positive and fetch_threads at least 1: {self.fetch_timeout_s}, "
                f"{self.fetch_threads}"
            )


@dataclass(frozen=True)
class WorkerConfig:
    """`loraserve worker`'s own settings (the engine's are EngineConfig's), and the keys it talks with."""

    worker_id: str | None = setting(None, "unique name (default: host-pid)")  # `main` sets it
    scheduler_address: str = setting(SCHEDULER_WORKER_ADDRESS, "the scheduler's ZMQ worker address")
    fetch: FetchConfig = field(default_factory=FetchConfig)
    report_interval_s: float = setting(
        0.25, "seconds between state reports when idle (busy: one after every step)", flag="--report-interval"
    )
    drain_timeout_s: float = setting(
        DRAIN_TIMEOUT_S,
        "on SIGTERM, seconds to let requests in flight finish before handing them back to fail over",
        flag="--drain-timeout",
    )
    torch_threads: int | None = setting(
        None, "torch intra-op CPU threads (default: torch's choice; fewer when other roles share the CPU)"
    )
    heartbeat_interval_s: float = setting(
        0.25,
        "seconds between heartbeats to the scheduler, sent by the I/O thread however long a step takes",
        flag="--heartbeat-interval",
    )
    grammar_threads: int = setting(2, "threads building structured-output matchers (and first masks) off the step loop")
    cpu_cores: str = setting(
        "",
        'CPU cores this worker computes on, such as "1" or "2-5,8": its step loop while it steps, and torch\'s '
        "threads (its threads that wait on sockets, and the step loop while it waits for work, run anywhere); "
        "empty: wherever the OS puts them",
    )
    pin_all_threads: bool = setting(
        False,
        "with --cpu-cores, every thread of the worker on those cores, its socket threads too: none then holds "
        "the interpreter on another core while the step waits (a busy neighbour there can delay its heartbeats)",
    )
    keys: InternalKeys | None = None  # CURVE keys: talk to the scheduler, store and gateways as a worker

    def __post_init__(self) -> None:
        parse_cores(self.cpu_cores)  # InvalidConfigError naming a malformed list or a core not available
        if self.pin_all_threads and not self.cpu_cores:
            raise InvalidConfigError("pin_all_threads needs cpu_cores (--cpu-cores): the cores to pin them to")
        if not (self.report_interval_s > 0 and self.heartbeat_interval_s > 0 and self.grammar_threads >= 1):
            raise InvalidConfigError(
                "the report and heartbeat intervals must be positive and grammar_threads at least 1: "
                f"{self.report_interval_s}, {self.heartbeat_interval_s}, {self.grammar_threads}"
            )

    def step_cores(self) -> StepCores:
        """The step loop's cores: `cpu_cores` while it steps; anywhere while it waits, unless every thread is pinned."""
        cores = parse_cores(self.cpu_cores)
        return StepCores(cores, cores if self.pin_all_threads else None)

    def curve_to(self, role: str) -> Curve | None:
        return self.keys.client_of(role) if self.keys is not None else None

    def fetching(self) -> FetchConfig:
        """The fetches' configuration, with the CURVE options for the store's data port."""
        return replace(self.fetch, curve=self.curve_to("store"))
