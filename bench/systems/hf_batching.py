"""Static batching with transformers' `generate`, shared by the PEFT and merge-and-swap baselines.

Both serve one adapter at a time: requests wait in one FIFO queue per adapter; a batch is up to
`max_batch_size` queued requests of the chosen adapter, prompts left-padded, decoded greedily for
the batch's largest max_new_tokens (EOS ignored, as the engine's requests do). A streamer stamps
every step, so each request's first token and its own last token are timed as they are produced
— what a streaming server would send — while the batch keeps running until its longest request is
done. The policy that picks the next adapter, and what switching costs, are the systems' own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from loraserve.bench.systems.base import Replay
from loraserve.bench.workloads.slora import TraceRequest

PAD_ID = 2  # the demo tokenizer's </s>; any id works since padded positions are masked
GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": PAD_ID}  # greedy, EOS ignored (as in the engine)


class AdapterQueues:
    """One FIFO queue of waiting requests per adapter."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[TraceRequest]] = {}

    def add(self, requests: list[TraceRequest]) -> None:
        for r in requests:
            self.queues.setdefault(r.adapter, deque()).append(r)

    def __bool__(self) -> bool:
        return any(self.queues.values())

    def length(self, adapter: str | None) -> int:
        return len(self.queues.get(adapter, ())) if adapter is not None else 0

    def oldest(self) -> str:
        """The adapter whose head request arrived first."""
        return min((q[0].arrival_s, a) for a, q in self.queues.items() if q)[1]

    def longest(self) -> str:
        """The adapter with the most waiting requests (ties: the oldest head)."""
        return min((-len(q), q[0].arrival_s, a) for a, q in self.queues.items() if q)[2]

    def take(self, adapter: str, max_batch_size: int) -> list[TraceRequest]:
        queue = self.queues[adapter]
        return [queue.popleft() for _ in range(min(max_batch_size, len(queue)))]


class _StepStamps(BaseStreamer):
    """Stamps the batch's steps: first token of every request, and each one's own last token."""

    def __init__(self, replay: Replay, batch: list[TraceRequest]):
        self.replay, self.batch, self.steps, self.prompt_seen = replay, batch, 0, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompts
            self.prompt_seen = True
            return
        self.steps += 1
        now = self.replay.now()
        for r in self.batch:
            if self.steps <= r.max_new_tokens:
                self.replay.tokens(r.request_id, 1, now)
            if self.steps == r.max_new_tokens:
                self.replay.finish(r.request_id, now)

    def end(self) -> None:
        pass


class _Deadline(StoppingCriteria):
    def __init__(self, replay: Replay):
        self.replay = replay

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.replay.expired, dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def generate_batch(model, batch: list[TraceRequest], replay: Replay) -> None:
    """Run one static batch to the end (or the deadline), recording its requests' timings."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
        mask[i, width - r.prompt_len :] = 1
    model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=max(r.max_new_tokens for r in batch),
        streamer=_StepStamps(replay, batch),
        stopping_criteria=StoppingCriteriaList([_Deadline(replay)]),
        **GREEDY,
    )


def load_base_model(model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def warm_up(model) -> None:
    """One tiny generate before the clock starts (first-call costs are not the trace's)."""
    ids = torch.tensor([[5, 6, 7, 8]], device=model.device)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, **GREEDY)


def serve_one_adapter_at_a_time(
    model,
    replay: Replay,
    max_batch_size: int,
    pick: Callable[[AdapterQueues, str | None], str],
    switch: Callable[[str], None],
) -> dict:
    """Replay the trace one adapter at a time: `pick(queues, active)` names the adapter to serve
    next, `switch(adapter)` makes it the model's active one (timed); returns switch and batch stats."""
    queues, active = AdapterQueues(), None
    switches, switch_s, batches, batched = 0, 0.0, 0, 0
    replay.start()
    while not replay.done:
        queues.add(replay.due())
        if not queues:
            replay.wait_for_arrival()
            continue
        adapter = pick(queues, active)
        if adapter != active:
            start = time.perf_counter()
            switch(adapter)
            switch_s += time.perf_counter() - start
            active, switches = adapter, switches + 1
        batch = queues.take(adapter, max_batch_size)
        generate_batch(model, batch, replay)
        batches, batched = batches + 1, batched + len(batch)
    return {
        "adapter_switches": switches,
        "switch_s": round(switch_s, 4),
        "mean_switch_ms": round(1000 * switch_s / switches, 3) if switches else 0.0,
        "batches": batches,
        "mean_batch_size": batched / batches if batches else 0.0,
    }
