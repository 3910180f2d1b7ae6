"""The multi-LoRA engine: continuous batching of many adapters over one unified page pool.

    engine = Engine("path/to/model", EngineConfig(device="cpu"))
    engine.register_adapter("upper", "path/to/adapter")
    results = engine.generate([GenerateRequest(prompt="the quiet king", adapter="upper")])

Each `step()` is schedule → load adapters → execute → update: the step scheduler decides which
requests run (and preempts when the pool is full), adapters given pages are copied in (or were
prefetched in the background), the runner runs one forward pass over all scheduled tokens and
samples, and finished requests release their pages.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraserve.errors import AdapterNotFoundError, InvalidRequestError, ResourceExhaustedError
from loraserve.kernels.backend import select_backend
from loraserve.tokenizer import Tokenizer
from loraserve.worker.adapter_cache import AdapterLoader, AdapterRegistry
from loraserve.worker.adapters import LoraAdapter, load_adapter_bytes, load_adapter_dir
from loraserve.worker.config import EngineConfig
from loraserve.worker.model import load_model
from loraserve.worker.model_config import ModelConfig
from loraserve.worker.page_pool import PagePool
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.request import AdapterKey, FinishReason, Request
from loraserve.worker.runner import ModelRunner
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.step_scheduler import StepScheduler

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step did for one request: at most one new token, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_status: str = "RESOURCE_EXHAUSTED"  # the grpc.StatusCode name for an ERROR finish


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


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device, self.model_config.torch_dtype)
        self.model = load_model(model_dir, self.model_config, self.device, self.dtype)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.layout = PoolLayout.for_model(self.model_config, config.rows_per_page, self._pool_pages())
        # The unified pool: ONE buffer for KV cache and adapter weights (see pool_layout.py).
        self.pool = torch.zeros(
            self.layout.num_layers,
            self.layout.rows_per_layer,
            self.layout.row_width,
            dtype=self.dtype,
            device=self.device,
        )
        fraction = config.adapter_pool_fraction
        self.pages = PagePool(self.layout, max(1, int(self.layout.num_pages * fraction)) if fraction else None)
        self.registry = AdapterRegistry(budget_bytes=config.adapter_cache_bytes)
        self.loader = AdapterLoader(self.registry, self.pool, self.layout, self.model_config)
        self.scheduler = StepScheduler(
            self.pages, self.loader.footprint, config.max_batch_size, config.max_batched_tokens
        )
        self.runner = ModelRunner(self.model, self.pool, self.layout, select_backend(config.backend, self.device))
        self.requests: dict[str, Request] = {}
        self._aborted: dict[str, str | None] = {}
        self._prefetching: set[AdapterKey] = set()  # pinned while their background copy runs
        self._seeds = itertools.count(config.seed)
        self.steps = 0
        # Bytes a step must read: every weight of the base model once (embeddings aside, unless tied
        # to the output layer), plus the weights of each distinct adapter in the batch.
        self.base_bytes = sum(
            p.numel() * p.element_size()
            for name, p in self.model.named_parameters()
            if "embed_tokens" not in name or self.model_config.tie_word_embeddings
        )
        self.adapter_bytes_read = 0
        log.info(
            "unified pool: %d pages x %d rows x %d wide x %d layers (%.1f MiB, %d tokens per KV page)",
            self.layout.num_pages, self.layout.rows_per_page, self.layout.row_width, self.layout.num_layers,
            self.pool.numel() * self.pool.element_size() / 2**20, self.layout.tokens_per_page,
        )  # fmt: skip

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

    def add_adapter(self, name: str, adapter: LoraAdapter, version: int | None = None) -> AdapterKey:
        """Register an adapter that is already validated."""
        previous = self.registry.latest(name) if name in self.registry.names() else None
        key = self.registry.register(name, adapter, version)
        if previous is not None and previous != key:
            self._drop_if_stale(previous)
        log.info("adapter %s v%d: rank %d on %s", name, key[1], adapter.rank, ",".join(adapter.modules))
        return key

    def unregister_adapter(self, name: str) -> None:
        key = self.registry.latest(name)
        self.registry.unregister(name)
        self._drop_if_stale(key)

    def adapter_names(self) -> list[str]:
        return self.registry.names()

    def _drop_if_stale(self, key: AdapterKey) -> None:
        """Free the pool pages of an adapter version no request can use any more."""
        if self.registry.is_current(key) or not self.pages.is_resident(key) or self.pages.is_pinned(key):
            return
        self.pages.free_adapter(key)
        self.loader.evicted(key)

    def prefetch(self, adapters: Iterable[str | AdapterKey]) -> list[AdapterKey]:
        """Start copying these adapters (names mean their latest version) into free pool pages."""
        keys = []
        for a in adapters:
            key = self.registry.latest(a) if isinstance(a, str) else a
            if self.registry.has(key):
                keys.append(key)
        reserve = 0 if self.pages.split else int(self.layout.num_pages * self.config.prefetch_reserve)
        started, evicted = self.scheduler.plan_prefetch(keys, reserve)
        for key in evicted:
            self.loader.evicted(key)
        for key in started:
            self.pages.pin(key)  # a page being written must not be handed to anyone else
            self._prefetching.add(key)
            self.loader.prefetch(key, self.pages.adapter_pages(key))
        return started

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        adapter: str | AdapterKey | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queue a request for an adapter name (its latest version), an exact (name, version), or None.

        Raises InvalidRequestError / AdapterNotFoundError / ResourceExhaustedError.
        """
        sampling = sampling or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self._check_prompt(prompt_ids, sampling)
        key = self._resolve(adapter)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(sampling.seed if sampling.seed is not None else next(self._seeds))
        request = Request(request_id, list(prompt_ids), sampling, key, generator=generator)
        if key is not None:
            self.registry.hold(key)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _check_prompt(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt", "is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("prompt_ids", f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + sampling.max_new_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
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
        return self.scheduler.has_work() or bool(self._aborted)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = [self._finish(rid, FinishReason.ERROR if err else FinishReason.CANCELLED, err)
                   for rid, err in self._aborted.items() if rid in self.requests]  # fmt: skip
        self._aborted.clear()
        self._settle_prefetches()
        plan = self.scheduler.schedule()
        for key in plan.evicted:
            self.loader.evicted(key)
        for key in plan.adapter_loads:
            self.loader.load_now(key, self.pages.adapter_pages(key))
        if not plan.scheduled:
            self._fail_unschedulable(outputs)
            return outputs
        now = time.monotonic()
        in_batch = {r.adapter for r, _ in plan.scheduled if r.adapter is not None}
        for key in in_batch:
            waited = self.loader.wait(key)
            for r, _ in plan.scheduled:
                if r.adapter == key and r.first_scheduled is None:
                    r.adapter_wait_s += waited
        for r, _ in plan.scheduled:
            r.first_scheduled = r.first_scheduled or now
        if self.config.prefetch:
            self.prefetch([r.adapter for r in itertools.islice(self.scheduler.waiting, self.config.prefetch_depth)
                           if r.adapter is not None])  # fmt: skip
        sampled = self.runner.execute(plan.scheduled, self.pages, self.loader.resident)
        self.steps += 1
        self.adapter_bytes_read += self.pool.element_size() * sum(
            self.loader.resident[key].layout.useful_elements for key in in_batch
        )
        now = time.monotonic()
        for request, _ in plan.scheduled:
            if request.request_id not in sampled:
                continue  # a prefill chunk that does not end its prompt
            token = sampled[request.request_id]
            if token is None:
                log.warning("request %s (adapter %s): non-finite logits, ended", request.request_id, request.adapter)
                outputs.append(
                    self._finish(request.request_id, FinishReason.ERROR, NON_FINITE_ERROR, status="FAILED_PRECONDITION")
                )
                continue
            request.output_ids.append(token)
            request.first_token = request.first_token or now
            reason = self._stop_reason(request, token)
            if reason is None:
                outputs.append(StepOutput(request.request_id, [token], False))
            else:
                outputs.append(self._finish(request.request_id, reason, None, [token]))
        return outputs

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        s = request.sampling
        if (token in self.tokenizer.eos_token_ids and not s.ignore_eos) or token in s.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_ids) >= s.max_new_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(
        self, request_id: str, reason: FinishReason, error: str | None, tokens=(), status: str = "RESOURCE_EXHAUSTED"
    ) -> StepOutput:
        """End a request and free what it holds; `status` is the gRPC status of an ERROR finish."""
        request = self.requests.pop(request_id)
        self.scheduler.finish(request, reason, error)
        request.finished_at = time.monotonic()
        if request.adapter is not None:
            self.registry.release(request.adapter)
            self._drop_if_stale(request.adapter)
        return StepOutput(request_id, list(tokens), True, reason, error, status)

    def _settle_prefetches(self) -> None:
        for key in [k for k in self._prefetching if self.loader.copy_done(k)]:
            self._prefetching.discard(key)
            self.pages.unpin(key)

    def _fail_unschedulable(self, outputs: list[StepOutput]) -> None:
        """Nothing could run: if nothing is running either, the queue's head can never fit."""
        if self.scheduler.running or not self.scheduler.waiting or self._prefetching:
            return
        head = self.scheduler.waiting[0]
        outputs.append(self._finish(
            head.request_id, FinishReason.ERROR,
            "the request does not fit in the page pool even when it runs alone (adapter + KV pages)",
        ))  # fmt: skip

    # ---- offline API ---------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Run a batch of requests to completion, all in one continuous batch; results in input order."""
        added = []
        for i, g in enumerate(requests):
            ids = g.prompt_ids if g.prompt_ids is not None else self.tokenizer.encode(g.prompt or "")
            added.append(
                self.add_request(ids, g.sampling, g.adapter, g.request_id or f"gen-{i}-{uuid.uuid4().hex[:8]}")
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
            )
            for r in added
        ]

    def stats(self) -> dict:
        return {
            "pool": self.pages.stats().as_dict(),
            "adapters": vars(self.loader.stats).copy(),
            "base_bytes": self.base_bytes,
            "adapter_bytes_read": self.adapter_bytes_read,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "steps": self.steps,
        }

    def close(self) -> None:
        self.loader.close()
