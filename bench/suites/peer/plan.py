"""What the peer suite sends, and in which order: pure, no I/O.

A pairing is one comparison: `base` (requests name the base model) or `lora` (requests round-robin
over the adapters). Every run of a pairing sends the same requests — same prompts (token ids), same
`model` per request — so the two systems' greedy outputs can be compared request by request.
Runs alternate between the systems: A, B, A, B, ... so slow drift of the machine (other load,
thermal state) falls on both alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAIRINGS = ("base", "lora")
FIRST_TOKEN_ID = 3  # the demo tokenizer's ids 0-2 are <unk>, <s>, </s>: prompts never hold them


@dataclass(frozen=True)
class Request:
    """One completion request: its prompt as token ids and the `model` it names."""

    prompt_ids: tuple[int, ...]
    model: str


@dataclass(frozen=True)
class Run:
    """One timed run: a pairing's requests sent to one system, the `repeat`-th time."""

    pairing: str
    system: str
    repeat: int


def adapter_names(count: int) -> list[str]:
    """The adapters' names, the same on both systems."""
    return [f"peer-{i:02d}" for i in range(count)]


def adapter_ranks(count: int, ranks: tuple[int, ...]) -> dict[str, int]:
    """{name: rank}, ranks assigned round-robin."""
    return {name: ranks[i % len(ranks)] for i, name in enumerate(adapter_names(count))}


def requests(
    pairing: str, count: int, prompt_len: int, vocab: int, base_model: str, adapters: list[str], seed: int
) -> list[Request]:
    """The requests of `pairing`: `count` seeded random prompts of `prompt_len` token ids; `model` is the
    base model's name (base) or the adapters' names round-robin (lora)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"unknown pairing {pairing!r}: one of {PAIRINGS}")
    if pairing == "lora" and not adapters:
        raise ValueError("the lora pairing needs adapters")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(FIRST_TOKEN_ID, vocab, size=(count, prompt_len))
    names = [base_model] if pairing == "base" else adapters
    return [Request(tuple(int(t) for t in row), names[i % len(names)]) for i, row in enumerate(prompts)]


def alternation(pairing: str, systems: tuple[str, ...], repeats: int) -> list[Run]:
    """The runs of one pairing, alternating: systems[0], systems[1], systems[0], ... `repeats` each."""
    return [Run(pairing, system, repeat) for repeat in range(repeats) for system in systems]
