"""The multi-LoRA engine: continuous batching of many adapters over one unified page pool.

    engine = Engine("path/to/model", EngineConfig(device="cpu"))
    engine.register_adapter("upper", "path/to/adapter")
    results = engine.generate([GenerateRequest(prompt="the quiet king", adapter="upper")])

Each `step()` is three calls on plain data, as in nano-vllm and vLLM v1:

    plan = step_scheduler.schedule()        # which requests run, how many tokens each (StepPlan)
    output = runner.execute(plan.batch)     # one forward pass over all their tokens, then sampling
    outputs = results.apply(plan, output)   # the only place request state changes (step_results.py)

With `EngineConfig(runner="emulated")` (a benchmark and test tool) the runner is an `EmulatedRunner`:
no weights, each step sleeps the time a measured profile predicts and emits deterministic tokens
(`emulated/runner.py`); everything else here is the same.

The step scheduler also makes each request's adapter resident through the unified pool (copying it
in unless a prefetch did) and preempts when the pool is full; `StepResults.apply` appends tokens,
checks stops, sets timestamps and finishes requests, whose pages go back to the pool. How the pool
is sized and the runner built is `engine_setup.py`.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraserve.errors import InvalidRequestError, LoraserveError
from loraserve.model_config import ModelConfig
from loraserve.partition import local_model
from loraserve.prefix_keys import SequenceFingerprints, chain_root
from loraserve.request_spec import RequestSpec
from loraserve.tokenizer import Tokenizer
from loraserve.wire import AdapterKey, TokenLogprob
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.config import EngineConfig
from loraserve.worker.emulated.runner import EmulatedRunner
from loraserve.worker.engine_adapters import EngineAdapters
from loraserve.worker.engine_setup import (
    adapter_dtype,
    base_bytes,
    check_prompt,
    model_runner,
    pool_pages,
    start_ranks,
)
from loraserve.worker.grammar import GrammarMatchers
from loraserve.worker.model import load_model
from loraserve.worker.pool_copier import PoolCopier
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.request import FinishReason, Request
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.step_results import StepOutput, StepResults, StepShape
from loraserve.worker.step_runner import Runner
from loraserve.worker.step_scheduler import StepScheduler
from loraserve.worker.tensor_parallel.loads import SharingCopier
from loraserve.worker.unified_pool import UnifiedPool

log = logging.getLogger(__name__)


class Cached(enum.Enum):
    """`Engine.cached`'s answer."""

    YES = "yes"
    NO = "no"  # fetch it
    STALE_IN_USE = "stale_in_use"  # cached with other weights that running requests still use


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

    @classmethod
    def of(cls, r: Request, tokenizer: Tokenizer) -> GenerateResult:
        """A finished request's result."""
        return cls(
            request_id=r.request_id,
            adapter=r.spec.adapter,
            prompt_ids=r.spec.prompt_ids,
            token_ids=r.output_ids,
            text=tokenizer.decode(r.output_ids),
            finish_reason=r.finish_reason,
            error=r.error,
            num_preemptions=r.num_preemptions,
            logprobs=r.logprobs,
            prompt_logprobs=list(r.prompt_logprobs or ()),
        )


class Engine:
    """One model, many adapters, continuous batching over one unified pool (see the module docstring)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self.grammars = GrammarMatchers(self.tokenizer, self.model_config.vocab_size)  # structured output
        # The emulated runner (a benchmark and test tool, `emulated/runner.py`): no weights, steps wait. Its
        # profile is read, and checked against the model, before anything is allocated.
        emulated = config.runner == "emulated"
        runner = None
        if emulated:
            runner = EmulatedRunner.from_profile(config.runner_profile, self.model_config, self.tokenizer)
        self.device = torch.device("cpu") if emulated else config.torch_device()
        self.dtype = config.torch_dtype(self.device, self.model_config.torch_dtype)
        # Tensor parallelism: this process is rank 0 and starts the others (`tensor_parallel/leader.py`).
        shard, self.leader = start_ranks(config, self.model_dir, self.model_config, self.device)
        self.model = None if emulated else load_model(model_dir, self.model_config, self.device, self.dtype, shard)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        pages = pool_pages(config, local_model(self.model_config, shard), self.dtype, self.device)
        self.layout = PoolLayout.for_model(self.model_config, config.rows_per_page, pages, shard)
        self.registry = AdapterRegistry(budget_bytes=config.adapter_cache_bytes)  # adapters in host RAM
        fraction = config.adapter_pool_fraction
        adapter_pages = max(1, int(self.layout.num_pages * fraction)) if fraction else None
        # The unified pool: ONE buffer for KV cache and adapter weights (see pool_layout.py). Emulated, its
        # memory is taken only where adapters are copied in (nothing writes KV).
        self.pool = UnifiedPool(
            self.layout,
            self.model_config,
            self.registry,
            self.dtype,
            self.device,
            adapter_pages,
            zeroed=not emulated,
            copier=PoolCopier if self.leader is None else SharingCopier,
            adapter_dtype="pool" if emulated or self.leader else adapter_dtype(config, self.device, self.dtype),
        )
        self.step_scheduler = StepScheduler(self.pool, config.max_batch_size, config.max_batched_tokens)
        queued = lambda: (r.spec.adapter_key for r in self.step_scheduler.waiting)  # noqa: E731
        self.adapters = EngineAdapters(config, self.model_config, self.layout, self.registry, self.pool, queued)
        self.warm_up_seconds = None
        if runner is None:
            args = (self.model, self.pool, self.layout, self.model_config, self.max_model_len, self.device)
            runner, self.warm_up_seconds = model_runner(config, *args, leader=self.leader)
        self.runner: Runner = runner
        self.requests: dict[str, Request] = {}
        self.results = StepResults(
            self.requests, self.step_scheduler, self.pool, self.registry, self.tokenizer, self.max_model_len
        )
        self._aborted: dict[str, str | None] = {}  # request id -> error (None: cancelled), ended next step
        self._seeds = itertools.count(config.seed)
        self.steps = 0
        # Bytes a step must read: every weight of the base model once (embeddings aside, unless tied
        # to the output layer), plus the weights of each distinct adapter in the batch.
        self.base_bytes = base_bytes(self.model_dir, self.model_config, self.dtype)
        self.adapter_bytes_read = 0
        self.last_step: StepShape | None = None  # the last step's batch composition; None if it computed nothing
        log.info("unified pool: %s", self.layout.describe(self.pool.tensor.element_size()))

    # ---- adapters (the rest: `engine.adapters`, engine_adapters.py) ------------------------------
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
        return self.adapters.add(name, self.adapters.load(path, config_json, weights, weights_format), version)

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
        guide: Any = None,
    ) -> Request:
        """Queue a request for an adapter name (its latest version), an exact (name, version), or None.

        `group`: requests of one group with the same adapter and prompt compute the prompt's KV once
        (shared prefill, `step_scheduler`): the n choices of one prompt. `cache_salt`: only requests
        with the same salt share cached KV (`loraserve/prefix_keys.py`; the worker passes the tenant's).

        `output_ids` continues a request another worker started (failover): the tokens it already
        generated are recomputed with the prompt, as after a preemption, and count against
        max_new_tokens and the penalties exactly as if generated here.

        `guide`: with a grammar, its matcher built already (`GrammarMatchers.matcher`, at the end of
        `output_ids`): the worker builds it off its step loop (`worker/guide_builds.py`). None: built here,
        which may take long for a costly grammar (the offline API).

        Raises InvalidRequestError / AdapterNotFoundError / ResourceExhaustedError.
        """
        sampling = sampling or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        output_ids = list(output_ids or ())
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        check_prompt(
            prompt_ids + output_ids, sampling, len(output_ids), self.model_config, self.max_model_len, self.layout
        )
        key = self.adapters.resolve(adapter)
        if sampling.grammar is None:
            guide = None
        elif guide is None:
            guide = self.grammars.matcher(sampling.grammar, output_ids)
        seed = sampling.seed if sampling.seed is not None else next(self._seeds)
        if spec is None:
            request = Request.offline(
                request_id, prompt_ids, sampling, key, output_ids=output_ids, group=group, cache_salt=cache_salt
            )
        else:
            request = Request(spec, output_ids=output_ids)
        request.seed, request.guide = seed, guide
        if self.config.prefix_cache:
            request.chain_root = chain_root(cache_salt, self.adapters.identity(key))
            request.fingerprints = SequenceFingerprints(request.chain_root)
        if sampling.prompt_logprobs is not None and not output_ids:  # a continued request reported them
            request.prompt_logprobs = [None] * (len(prompt_ids) - 1)
        if key is not None:
            self.registry.hold(key)
        self.requests[request_id] = request
        self.step_scheduler.add(request)
        return request

    def add_spec(self, spec: RequestSpec, guide: Any = None) -> Request:
        """Queue a request the scheduler placed here, with its grammar's matcher if it has one (built off the
        step loop); its Request holds `spec` unchanged, and the sampler reads the spec's SamplingParams
        (`add_request` says what it raises)."""
        if spec.sampling.grammar is not None and guide is None:
            raise LoraserveError(f"request {spec.request_id}: its structured-output matcher was not built beforehand")
        return self.add_request(
            spec.prompt_ids,
            spec.sampling,
            spec.adapter_key,
            spec.request_id,
            spec.output_ids,
            group=spec.group,
            cache_salt=spec.cache_salt,
            spec=spec,
            guide=guide,
        )

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Cancel a request; its pages are freed at the start of the next step."""
        if request_id in self.requests:
            self._aborted[request_id] = error

    def has_unfinished(self) -> bool:
        return self.step_scheduler.has_work() or bool(self._aborted)

    def check_ranks(self) -> None:
        """RuntimeError when the model is split and another rank's process has exited (`Leader.check`)."""
        if self.leader is not None:
            self.leader.check()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = [
            self.results.finish(rid, FinishReason.ERROR if err else FinishReason.CANCELLED, err)
            for rid, err in self._aborted.items()
            if rid in self.requests
        ]
        self._aborted.clear()
        self.last_step = None
        self.pool.settle()
        plan = self.step_scheduler.schedule()
        if not plan.scheduled:
            self.results.fail_unschedulable(outputs)
            return outputs
        scheduled_at = time.monotonic()
        by_layer = self.runner.waits_per_layer  # an adapter still being copied in: waited for per layer
        waited = {key: self.pool.wait_ready(key, by_layer) for key in plan.adapters}
        if self.config.prefetch:  # adapters of the requests queued next: needed for sure
            waiting = itertools.islice(self.step_scheduler.waiting, self.config.prefetch_depth)
            self.adapters.start([r.spec.adapter_key for r in waiting if r.spec.adapter])
        output = self.runner.execute(plan.batch, plan.kv_copies)
        for key in waited if by_layer else ():
            waited[key] += self.pool.layer_wait_s(key)
        self.steps += 1
        self.adapter_bytes_read += self.pool.tensor.element_size() * sum(
            self.pool.slot(key).useful_elements for key in plan.adapters
        )
        self.last_step = StepShape.of(plan, self.pool, self.layout.tokens_per_page)
        return outputs + self.results.apply(plan, output, scheduled_at, waited)

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
        return [GenerateResult.of(r, self.tokenizer) for r in added]

    def stats(self) -> dict:
        return {
            "pool": self.pool.pages.stats().as_dict(),
            "adapters": vars(self.pool.stats).copy(),
            "base_bytes": self.base_bytes,
            "adapter_bytes_read": self.adapter_bytes_read,
            "running": len(self.step_scheduler.running),
            "waiting": len(self.step_scheduler.waiting),
            "steps": self.steps,
        }

    def close(self) -> None:
        self.pool.copier.close()
        self.runner.masks.close()
        if self.leader is not None:
            self.leader.close()
