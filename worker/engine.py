"""The multi-LoRA engine: continuous batching of many adapters over one unified page pool.

    engine = Engine("path/to/model", EngineConfig(device="cpu"))
    engine.register_adapter("upper", "path/to/adapter")
    results = engine.generate([GenerateRequest(prompt="the quiet king", adapter="upper")])

Each `step()` is three calls on plain data, as in nano-vllm and vLLM v1:

    plan = step_scheduler.schedule()        # which requests run, how many tokens each (StepPlan)
    output = runner.execute(plan.batch)     # one forward pass over all their tokens, then sampling
    outputs = self._update(plan, output)    # the only place request state changes

With `EngineConfig(runner="emulated")` (a benchmark and test tool) the runner is an `EmulatedRunner`:
no weights, each step sleeps the time a measured profile predicts and emits deterministic tokens
(`emulated_runner.py`); everything else here is the same.

The step scheduler also makes each request's adapter resident through the unified pool (copying it
in unless a prefetch did) and preempts when the pool is full; `_update` appends tokens, checks
stops, sets timestamps and finishes requests, whose pages go back to the pool.

Who owns what: the engine owns the requests (`requests`, aborts), the step scheduler the waiting
and running queues, `UnifiedPool` the pool tensor, its pages, resident adapters and copies, and
`AdapterRegistry` the validated adapters in host RAM.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from loraserve.errors import AdapterNotFoundError, InvalidConfigError, InvalidRequestError, ResourceExhaustedError
from loraserve.kernels.backend import KernelBackend, select_backend
from loraserve.model_config import ModelConfig
from loraserve.prefix_keys import SequenceFingerprints, adapter_identity, chain_root
from loraserve.request_spec import RequestSpec
from loraserve.tokenizer import Tokenizer
from loraserve.wire import AdapterKey, TokenLogprob
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.adapters import LoraAdapter, load_adapter_bytes, load_adapter_dir
from loraserve.worker.config import EngineConfig
from loraserve.worker.emulated_runner import EmulatedRunner
from loraserve.worker.grammar import GrammarMatchers
from loraserve.worker.model import load_model
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.request import FinishReason, Request
from loraserve.worker.runner import DecodePadding, ModelRunner, RunnerOutput, step_capacity
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.step_scheduler import StepPlan, StepScheduler
from loraserve.worker.unified_pool import UnifiedPool
from loraserve.worker.warm_up import warm_up
from loraserve.worker.weights import tensor_sizes

log = logging.getLogger(__name__)

PAD_SEQUENCE = object()  # owns the KV page padded decode steps write to (no request id can equal it)


class Cached(enum.Enum):
    """`Engine.cached`'s answer."""

    YES = "yes"
    NO = "no"  # fetch it
    STALE_IN_USE = "stale_in_use"  # cached with other weights that running requests still use


@dataclass
class StepOutput:
    """What one step did for one request: at most one new token, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_status: str = "RESOURCE_EXHAUSTED"  # the grpc.StatusCode name for an ERROR finish
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the new tokens', when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with the first token, when asked for
    cached_tokens: int = 0  # with the first token: prompt tokens whose KV was found cached


# A request whose logits are NaN or infinite (or whose probabilities are not a distribution) ends
# with this; the others in its batch go on.
NON_FINITE_ERROR = (
    "the model produced non-finite logits for this request (NaN or infinity), so no token can be "
    "sampled; its adapter's weights are the likely cause: check them, or run without the adapter"
)


@dataclass(frozen=True)
class GenerateRequest:
    """An offline request: prompt text or token ids, an adapter name (None: the base model)."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    adapter: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    group: str | None = None  # shared prefill with the group's other requests of the same prompt


@dataclass
class GenerateResult:
    request_id: str
    adapter: str | None
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    error: str | None = None
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with sampling.logprobs
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with sampling.prompt_logprobs


class StepShape(NamedTuple):
    """One step's batch composition: tokens computed, Σ adapter rank over them, distinct adapters,
    KV pages the attention read."""

    tokens: int
    rank_tokens: int
    adapters: int
    kv_pages: int


class Engine:
    """One model, many adapters, continuous batching over one unified pool (see the module docstring)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.grammars = GrammarMatchers(self.tokenizer, self.model_config.vocab_size)  # structured output
        # The emulated runner (a benchmark and test tool, `emulated_runner.py`): no weights, steps wait. Its
        # profile is read, and checked against the model, before anything is allocated.
        emulated = config.runner == "emulated"
        runner = None
        if emulated:
            runner = EmulatedRunner.from_profile(config.runner_profile, self.model_config, self.tokenizer)
        self.device = torch.device("cpu") if emulated else config.torch_device()
        self.dtype = config.torch_dtype(self.device, self.model_config.torch_dtype)
        self.model = None if emulated else load_model(model_dir, self.model_config, self.device, self.dtype)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.layout = PoolLayout.for_model(self.model_config, config.rows_per_page, self._pool_pages())
        self.registry = AdapterRegistry(budget_bytes=config.adapter_cache_bytes)  # adapters in host RAM
        fraction = config.adapter_pool_fraction
        adapter_pages = max(1, int(self.layout.num_pages * fraction)) if fraction else None
        # The unified pool: ONE buffer for KV cache and adapter weights (see pool_layout.py). Emulated, its
        # memory is taken only where adapters are copied in (nothing writes KV).
        self.pool = UnifiedPool(
            self.layout, self.model_config, self.registry, self.dtype, self.device, adapter_pages, zeroed=not emulated
        )
        self.step_scheduler = StepScheduler(self.pool, config.max_batch_size, config.max_batched_tokens)
        self.warm_up_seconds = None
        self.runner: ModelRunner | EmulatedRunner = runner or self._model_runner()
        self.requests: dict[str, Request] = {}
        self._adapter_ids: dict[AdapterKey, str] = {}  # weights' identity per version, for prefix caching
        self._aborted: dict[str, str | None] = {}  # request id -> error (None: cancelled), ended next step
        self._seeds = itertools.count(config.seed)
        self.steps = 0
        # Bytes a step must read: every weight of the base model once (embeddings aside, unless tied
        # to the output layer), plus the weights of each distinct adapter in the batch.
        self.base_bytes = self._base_bytes()
        self.adapter_bytes_read = 0
        self.last_step: StepShape | None = None  # the last step's batch composition; None if it computed nothing
        log.info(
            "unified pool: %d pages x %d rows x %d wide x %d layers (%.1f MiB, %d tokens per KV page)",
            self.layout.num_pages,
            self.layout.rows_per_page,
            self.layout.row_width,
            self.layout.num_layers,
            self.pool.tensor.numel() * self.pool.tensor.element_size() / 2**20,
            self.layout.tokens_per_page,
        )

    def _base_bytes(self) -> int:
        """The base model's weights a step reads (embeddings aside, unless tied to the output layer); without
        a model (emulated), from the checkpoint's headers, as the model would hold them."""
        tied = self.model_config.tie_word_embeddings
        if self.model is not None:
            sizes = ((name, p.numel()) for name, p in self.model.named_parameters())
        else:  # the tensors `load_model` keeps
            sizes = (
                (name, n)
                for name, n in tensor_sizes(self.model_dir)
                if not name.endswith("rotary_emb.inv_freq") and not (tied and name == "lm_head.weight")
            )
        return self.dtype.itemsize * sum(n for name, n in sizes if "embed_tokens" not in name or tied)

    def _model_runner(self) -> ModelRunner:
        """The runner of the real model: kernels chosen, decode graphs captured and warmed up as configured."""
        config = self.config
        backend = select_backend(config.backend, self.device)
        capacity = step_capacity(config, self.layout, self.model_config, self.max_model_len)
        graphs = self._graph_mode(backend)
        warm = config.warm_up == "on" or (config.warm_up == "auto" and self.device.type == "cuda")
        # The scratch page: padded decode steps' pads and the warm-up's dummy steps write there.
        scratch = self.pool.reserve_kv_page(PAD_SEQUENCE) if config.pad_decode_steps or graphs or warm else None
        padding = DecodePadding(tuple(config.decode_buckets()), scratch) if config.pad_decode_steps or graphs else None
        runner = ModelRunner(self.model, self.pool.tensor, self.layout, backend, capacity, padding)
        if warm:
            self.warm_up_seconds = warm_up(runner, scratch, config.max_lora_rank, graphs)
        elif graphs is not None:
            runner.capture_decode_graphs(graphs, config.max_lora_rank)
        return runner

    def _graph_mode(self, backend: KernelBackend) -> str | None:
        """The decode graphs' mode (`worker.decode_graphs`), or None for none, from `cuda_graphs`."""
        mode = self.config.cuda_graphs
        if mode == "off":
            return None
        if backend.prepare_lora_graph is None:
            if mode == "uncaptured":
                raise InvalidConfigError(
                    f"engine config cuda_graphs='uncaptured' needs the triton kernel backend, not {backend.name}"
                )
            return None
        if mode == "auto":
            return "capture" if self.device.type == "cuda" else None
        return mode

    def _pool_pages(self) -> int:
        c = self.config
        if c.pool_pages is not None:
            return c.pool_pages
        page_bytes = self.model_config.num_layers * c.rows_per_page * self.model_config.kv_width * self.dtype.itemsize
        if c.pool_memory_gb is not None:
            budget = c.pool_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            m = self.model_config
            activations = c.max_batched_tokens * (6 * m.hidden_size + 3 * m.intermediate_size) * 4
            logits = c.max_batch_size * m.vocab_size * 8
            budget = free - (1 - c.gpu_memory_utilization) * total - 2 * (activations + logits)
        else:
            budget = c.cpu_pool_memory_gb * 2**30
        pages = int(budget // page_bytes)
        if pages < 1:
            raise ResourceExhaustedError(f"no memory left for the page pool ({budget / 2**20:.0f} MiB available)")
        return pages

    # ---- adapters ------------------------------------------------------------------------------
    def register_adapter(
        self,
        name: str,
        path: str | Path | None = None,
        *,
        config_json: bytes | str | None = None,
        weights: bytes | memoryview | None = None,
        weights_format: str = "safetensors",
        version: int | None = None,
    ) -> AdapterKey:
        """Validate and register an adapter from a PEFT directory or from its files' bytes.

        Re-registering a name makes a new version; requests already running keep theirs.
        """
        if path is not None:
            adapter = load_adapter_dir(path, self.model_config, self.config.max_lora_rank)
        elif config_json is not None and weights is not None:
            adapter = load_adapter_bytes(
                config_json, weights, self.model_config, self.config.max_lora_rank, weights_format
            )
        else:
            raise ValueError("register_adapter needs a path, or config_json and weights")
        return self.add_adapter(name, adapter, version)

    def cached(self, key: AdapterKey, sha256: str | None = None) -> Cached:
        """Does the engine hold `key` with weights hashing to `sha256` (None: any weights)? A copy with
        other weights (the store lost its data and gave the number out again) is dropped from host
        RAM and from the pool at once, unless requests still run with it (STALE_IN_USE)."""
        if self.registry.has(key, sha256):
            return Cached.YES
        if self.registry.has(key):
            return Cached.STALE_IN_USE
        self.pool.discard_stale(key)
        return Cached.NO

    def add_adapter(self, name: str, adapter: LoraAdapter, version: int | None = None) -> AdapterKey:
        """Register an adapter that is already validated."""
        previous = self.registry.latest(name) if name in self.registry.names() else None
        key = self.registry.register(name, adapter, version)
        self._adapter_ids[key] = adapter.sha256 or uuid.uuid4().hex  # a registration of unknown weights: its own
        if previous is not None and previous != key:
            self.pool.discard_stale(previous)
        log.info("adapter %s v%d: rank %d on %s", name, key[1], adapter.rank, ",".join(adapter.modules))
        return key

    def unregister_adapter(self, name: str) -> None:
        key = self.registry.latest(name)
        self.registry.unregister(name)
        self.pool.discard_stale(key)

    def adapter_names(self) -> list[str]:
        return self.registry.names()

    def prepare_adapter(self, adapter: LoraAdapter) -> LoraAdapter:
        """Pack `adapter` for this engine's pool ahead of its load (any thread: the worker's fetch threads)."""
        return self.pool.prepare(adapter)

    def prefetch(
        self, adapters: Sequence[str | AdapterKey], scores: Sequence[float] | None = None, *, demand: bool = False
    ) -> list[AdapterKey]:
        """Start copying these adapters (names mean their latest version) into the pool in the background.

        `scores`: the predicted likelihood that each is needed here soon, remembered per adapter
        (also for adapters not registered yet); a prefetch evicts only idle adapters with a lower
        score (`UnifiedPool`). Does nothing when the engine's `prefetch` is off, unless `demand`:
        the adapters were just fetched for requests that wait on them (a cold load, not a prediction,
        copied in the background all the same).
        """
        if not (self.config.prefetch or demand):
            return []
        keys: list[AdapterKey | None] = []
        for a in adapters:
            try:
                keys.append(self.registry.latest(a) if isinstance(a, str) else a)
            except AdapterNotFoundError:
                keys.append(None)
        if scores is not None:
            self.pool.remember_scores((k, s) for k, s in zip(keys, scores, strict=True) if k is not None)
        return self._prefetch([k for k in keys if k is not None and self.registry.has(k)], demand)

    def _prefetch(self, keys: list[AdapterKey], demand: bool = False) -> list[AdapterKey]:
        if not keys:
            return []
        needed = frozenset(r.adapter for r in self.step_scheduler.waiting if r.adapter is not None)
        reserve = int(self.layout.num_pages * self.config.prefetch_reserve)
        return self.pool.prefetch(keys, reserve, needed, demand)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        adapter: str | AdapterKey | None = None,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
        group: str | None = None,
        cache_salt: str = "",
        spec: RequestSpec | None = None,
    ) -> Request:
        """Queue a request for an adapter name (its latest version), an exact (name, version), or None.

        `group`: requests of one group with the same adapter and prompt compute the prompt's KV once
        (shared prefill, `step_scheduler`): the n choices of one prompt. `cache_salt`: only requests
        with the same salt share cached KV (`loraserve/prefix_keys.py`; the worker passes the tenant's).

        `output_ids` continues a request another worker started (failover): the tokens it already
        generated are recomputed with the prompt, as after a preemption, and count against
        max_new_tokens and the penalties exactly as if generated here.

        Raises InvalidRequestError / AdapterNotFoundError / ResourceExhaustedError.
        """
        sampling = sampling or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        output_ids = list(output_ids or ())
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self._check_prompt(prompt_ids + output_ids, sampling, len(output_ids))
        key = self._resolve(adapter)
        guide = self.grammars.matcher(sampling.grammar, output_ids) if sampling.grammar is not None else None
        seed = sampling.seed if sampling.seed is not None else next(self._seeds)
        request = Request(
            request_id,
            list(prompt_ids),
            sampling,
            key,
            output_ids=output_ids,
            seed=seed,
            guide=guide,
            group=group,
            spec=spec,
        )
        if self.config.prefix_cache:
            request.chain_root = chain_root(cache_salt, self._adapter_identity(key))
            request.fingerprints = SequenceFingerprints(request.chain_root)
        if sampling.prompt_logprobs is not None and not output_ids:  # a continued request reported them
            request.prompt_logprobs = [None] * (len(prompt_ids) - 1)
        if key is not None:
            self.registry.hold(key)
        self.requests[request_id] = request
        self.step_scheduler.add(request)
        return request

    def add_spec(self, spec: RequestSpec) -> Request:
        """Queue a request the scheduler placed here; its Request holds `spec` unchanged (`add_request` says
        what it raises). The spec's sampling values become the sampler's SamplingParams here, once."""
        return self.add_request(
            spec.prompt_ids,
            spec.sampling.params(),
            spec.adapter_key,
            spec.request_id,
            spec.output_ids,
            group=spec.group,
            cache_salt=spec.cache_salt,
            spec=spec,
        )

    def _adapter_identity(self, key: AdapterKey | None) -> str:
        """What a cached KV block's adapter is: name, version and weights (`loraserve/prefix_keys.py`)."""
        return "" if key is None else adapter_identity(key[0], key[1], self._adapter_ids.get(key, ""))

    def _check_prompt(self, token_ids: list[int], sampling: SamplingParams, generated: int = 0) -> None:
        """`token_ids`: the prompt, then the `generated` tokens of an earlier attempt."""
        if len(token_ids) == generated:
            raise InvalidRequestError("prompt", "is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("prompt_ids", f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if generated >= sampling.max_new_tokens:
            raise InvalidRequestError(
                "output_ids", f"{generated} tokens already generated; max_new_tokens is {sampling.max_new_tokens}"
            )
        prompt = len(token_ids) - generated
        total = prompt + sampling.max_new_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_new_tokens",
                f"prompt ({prompt} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
                f"exceeds the model's context length {self.max_model_len}",
            )
        pages = self.layout.kv_pages_for(total)
        if pages > self.layout.num_pages:
            raise ResourceExhaustedError(
                f"this request needs {pages} KV pages but the whole pool has {self.layout.num_pages}; "
                "lower max_new_tokens or shorten the prompt"
            )

    def _resolve(self, adapter: str | AdapterKey | None) -> AdapterKey | None:
        if not adapter:
            return None
        if isinstance(adapter, str):
            return self.registry.latest(adapter)
        if not self.registry.has(adapter):
            raise AdapterNotFoundError(f"{adapter[0]} v{adapter[1]}", self.registry.names())
        return adapter

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Cancel a request; its pages are freed at the start of the next step."""
        if request_id in self.requests:
            self._aborted[request_id] = error

    def has_unfinished(self) -> bool:
        return self.step_scheduler.has_work() or bool(self._aborted)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = [
            self._finish(rid, FinishReason.ERROR if err else FinishReason.CANCELLED, err)
            for rid, err in self._aborted.items()
            if rid in self.requests
        ]
        self._aborted.clear()
        self.last_step = None
        self.pool.settle()
        plan = self.step_scheduler.schedule()
        if not plan.scheduled:
            self._fail_unschedulable(outputs)
            return outputs
        scheduled_at = time.monotonic()
        by_layer = self.runner.waits_per_layer  # an adapter still being copied in: waited for per layer
        waited = {key: self.pool.wait_ready(key, by_layer) for key in plan.adapters}
        if self.config.prefetch:  # adapters of the requests queued next: needed for sure
            waiting = itertools.islice(self.step_scheduler.waiting, self.config.prefetch_depth)
            self._prefetch([r.adapter for r in waiting if r.adapter is not None])
        output = self.runner.execute(plan.batch, plan.kv_copies)
        for key in waited if by_layer else ():
            waited[key] += self.pool.layer_wait_s(key)
        return outputs + self._update(plan, output, scheduled_at, waited)

    def _shape(self, plan: StepPlan) -> StepShape:
        """What a step computed, in the terms of the scheduler's step-cost model (scheduler/cost_model.py)."""
        per_page = self.layout.tokens_per_page
        tokens = rank_tokens = kv_pages = 0
        for request, n in plan.scheduled:
            tokens += n
            if request.adapter is not None:
                rank_tokens += n * self.pool.slot(request.adapter).rank
            kv_pages += -(-(request.num_computed + n) // per_page)
        return StepShape(tokens, rank_tokens, len(plan.adapters), kv_pages)

    def _update(
        self, plan: StepPlan, output: RunnerOutput, scheduled_at: float, waited: dict[AdapterKey, float]
    ) -> list[StepOutput]:
        """Apply a step's results: the only place request state changes after scheduling."""
        self.steps += 1
        self.adapter_bytes_read += self.pool.tensor.element_size() * sum(
            self.pool.slot(key).useful_elements for key in plan.adapters
        )
        self.last_step = self._shape(plan)
        now = time.monotonic()
        outputs = []
        for request, n in plan.scheduled:
            if request.first_scheduled is None:
                request.first_scheduled = scheduled_at
                request.adapter_wait_s += waited.get(request.adapter, 0.0)
            scored = output.prompt_logprobs.get(request.request_id)
            if scored is not None:
                start = request.num_computed
                request.prompt_logprobs[start : start + len(scored)] = scored
            request.num_computed += n
            self.step_scheduler.cache_computed(request)
            if request.request_id not in output.sampled:
                continue  # a prefill chunk that does not end its prompt
            token = output.sampled[request.request_id]
            if token is None:
                log.warning("request %s (adapter %s): non-finite logits, ended", request.request_id, request.adapter)
                outputs.append(
                    self._finish(request.request_id, FinishReason.ERROR, NON_FINITE_ERROR, status="FAILED_PRECONDITION")
                )
                continue
            first = not request.output_ids
            request.output_ids.append(token)
            request.first_token = request.first_token or now
            logprobs = [output.logprobs[request.request_id]] if request.request_id in output.logprobs else []
            request.logprobs += logprobs
            error = self._advance_guide(request, token)
            reason = FinishReason.ERROR if error else self._stop_reason(request, token)
            if reason is None:
                step_output = StepOutput(request.request_id, [token], False)
            else:
                step_output = self._finish(request.request_id, reason, error, [token], status="INTERNAL")
            step_output.logprobs = logprobs
            if first and request.prompt_logprobs is not None:
                step_output.prompt_logprobs = list(request.prompt_logprobs)
            if first:
                step_output.cached_tokens = request.cached_tokens
            outputs.append(step_output)
        return outputs

    @staticmethod
    def _advance_guide(request: Request, token: int) -> str | None:
        """Move a guided request's grammar past its new token; the error if the grammar broke down."""
        if request.guide is None or request.guide.consume_token(token):
            return None
        return f"structured output: the grammar matcher failed: {request.guide.get_error()}"

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        s = request.sampling
        if (token in self.tokenizer.eos_token_ids and not s.ignore_eos) or token in s.stop_token_ids:
            return FinishReason.STOP
        if request.guide is not None and request.guide.is_stopped():  # the grammar is complete
            return FinishReason.STOP
        if len(request.output_ids) >= s.max_new_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(
        self, request_id: str, reason: FinishReason, error: str | None, tokens=(), status: str = "RESOURCE_EXHAUSTED"
    ) -> StepOutput:
        """End a request and free what it holds; `status` is the gRPC status of an ERROR finish."""
        request = self.requests.pop(request_id)
        self.step_scheduler.finish(request, reason, error)
        request.finished_at = time.monotonic()
        if request.adapter is not None:
            self.registry.release(request.adapter)
            self.pool.discard_stale(request.adapter)
        return StepOutput(request_id, list(tokens), True, reason, error, status)

    def _fail_unschedulable(self, outputs: list[StepOutput]) -> None:
        """Nothing could run: if nothing is running either, the queue's head can never fit."""
        if self.step_scheduler.running or not self.step_scheduler.waiting or self.pool.copying():
            return
        head = self.step_scheduler.waiting[0]
        outputs.append(
            self._finish(
                head.request_id,
                FinishReason.ERROR,
                "the request does not fit in the page pool even when it runs alone (adapter + KV pages)",
            )
        )

    # ---- offline API ---------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Run a batch of requests to completion, all in one continuous batch; results in input order."""
        added = []
        for i, g in enumerate(requests):
            ids = g.prompt_ids if g.prompt_ids is not None else self.tokenizer.encode(g.prompt or "")
            added.append(
                self.add_request(
                    ids, g.sampling, g.adapter, g.request_id or f"gen-{i}-{uuid.uuid4().hex[:8]}", group=g.group
                )
            )
        while any(not r.finished for r in added):
            self.step()
        return [
            GenerateResult(
                request_id=r.request_id,
                adapter=r.adapter[0] if r.adapter else None,
                prompt_ids=r.prompt_ids,
                token_ids=r.output_ids,
                text=self.tokenizer.decode(r.output_ids),
                finish_reason=r.finish_reason,
                error=r.error,
                num_preemptions=r.num_preemptions,
                logprobs=r.logprobs,
                prompt_logprobs=list(r.prompt_logprobs or ()),
            )
            for r in added
        ]

    def stats(self) -> dict:
        return {
            "pool": self.pool.page_stats().as_dict(),
            "adapters": vars(self.pool.stats).copy(),
            "base_bytes": self.base_bytes,
            "adapter_bytes_read": self.adapter_bytes_read,
            "running": len(self.step_scheduler.running),
            "waiting": len(self.step_scheduler.waiting),
            "steps": self.steps,
        }

    def close(self) -> None:
        self.pool.close()
        self.runner.masks.close()
