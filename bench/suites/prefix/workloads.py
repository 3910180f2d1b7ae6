"""The prefix suite's two workloads, each driven one engine step at a time (so two engines can take turns).

- `MultiTurn`: every conversation to its end, `concurrency` at a time (closed loop: a conversation's
  next turn is sent when its answer ends, and a new conversation starts when one ends);
- `UniquePrompts`: as many never-repeated prompts, of the multi-turn prompts' mean length,
  `concurrency` at a time.

    run = MultiTurn(engine, preset, seed)
    while not run.done:
        run.advance()          # top up to `concurrency` requests, then one engine step
    run.timeline.summary()
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraserve.bench.suites.prefix.timeline import Timeline

if TYPE_CHECKING:
    from loraserve.bench.suites.prefix.suite import PrefixPreset


@dataclass
class Conversation:
    adapter: str
    tenant: str
    history: list[int]  # system prompt, then every user message and answer so far
    turns_left: int


def conversations(preset: PrefixPreset, vocab: int, rng: random.Random) -> list[Conversation]:
    """`conversations` per adapter and tenant, each opening with its adapter's system prompt; shuffled."""
    systems = {
        f"a{i}": [1] + [rng.randrange(3, vocab) for _ in range(preset.system_tokens - 1)]
        for i in range(preset.adapters)
    }
    out = [
        Conversation(adapter, f"t{t}", list(system), preset.turns)
        for adapter, system in systems.items()
        for t in range(preset.tenants)
        for _ in range(preset.conversations)
    ]
    rng.shuffle(out)
    return out


class _Workload:
    """What both workloads keep: the engine and its timeline, a seeded rng, the answers' sampling; done when
    nothing is queued (a subclass's `queue`) or in flight (its `active`)."""

    def __init__(self, engine, preset: PrefixPreset, seed: int) -> None:
        from loraserve.worker.sampling import SamplingParams

        self.engine, self.preset = engine, preset
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.timeline = Timeline(engine)
        self.sampling = SamplingParams(max_new_tokens=preset.answer_tokens, temperature=1.0, ignore_eos=True)

    @property
    def done(self) -> bool:
        return not (self.queue or self.active)


class MultiTurn(_Workload):
    """Conversations over the adapters' system prompts; each request carries its tenant as the cache salt."""

    def __init__(self, engine, preset: PrefixPreset, seed: int) -> None:
        super().__init__(engine, preset, seed)
        self.queue = deque(conversations(preset, self.vocab, self.rng))
        self.active: dict[str, tuple[Conversation, object]] = {}  # request id -> (its conversation, the Request)
        self.sent = 0

    def _send(self, conversation: Conversation) -> None:
        conversation.history += [self.rng.randrange(3, self.vocab) for _ in range(self.preset.user_tokens)]
        self.sent += 1
        request = self.engine.add_request(
            list(conversation.history),
            self.sampling,
            conversation.adapter,
            f"r{self.sent}",
            cache_salt=conversation.tenant,
        )
        self.active[request.request_id] = (conversation, request)
        self.timeline.submitted(request, self.preset.turns - conversation.turns_left + 1)

    def advance(self) -> None:
        while self.queue and len(self.active) < self.preset.concurrency:
            self._send(self.queue.popleft())
        for out in self.timeline.step():
            if not out.finished or out.request_id not in self.active:
                continue
            conversation, request = self.active.pop(out.request_id)
            conversation.history += request.output_ids
            conversation.turns_left -= 1
            if conversation.turns_left:
                self._send(conversation)


class UniquePrompts(_Workload):
    """Prompts nobody sent before, as many as the multi-turn requests, of their mean length."""

    def __init__(self, engine, preset: PrefixPreset, seed: int) -> None:
        super().__init__(engine, preset, seed)
        count = preset.adapters * preset.tenants * preset.conversations * preset.turns
        self.length = int(
            preset.system_tokens
            + (preset.turns + 1) / 2 * preset.user_tokens
            + (preset.turns - 1) / 2 * preset.answer_tokens
        )
        self.queue = deque(range(count))
        self.active: set[str] = set()

    def advance(self) -> None:
        while self.queue and len(self.active) < self.preset.concurrency:
            i = self.queue.popleft()
            prompt = [1] + [self.rng.randrange(3, self.vocab) for _ in range(self.length - 1)]
            adapter = f"a{i % self.preset.adapters}"
            request = self.engine.add_request(prompt, self.sampling, adapter, f"u{i}", cache_salt=f"t{i % 2}")
            self.active.add(request.request_id)
            self.timeline.submitted(request)
        for out in self.timeline.step():
            if out.finished:
                self.active.discard(out.request_id)


WORKLOADS = {"multi-turn": MultiTurn, "unique": UniquePrompts}
