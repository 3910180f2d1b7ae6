"""Decoding an ASSIGN costs at most 0.2 µs of CPU per prompt token (msgspec: about 0.02 here; the former
hand-written checker took 0.12 on the same host). Run with `-s` to see the figure."""

from __future__ import annotations

import time
import timeit

from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.wire import Assign, decode, encode

PROMPT_TOKENS = 4096
MAX_US_PER_TOKEN = 0.2


def test_a_long_assign_decodes_within_its_budget():
    prompt = [(i * 7919) % 32000 for i in range(PROMPT_TOKENS)]
    sampling = SamplingParams(max_new_tokens=64, temperature=0.7, stop_token_ids=(2,))
    spec = RequestSpec("r1", prompt, sampling, "tcp://127.0.0.1:7201", time.time(), adapter="upper", adapter_version=2)
    frames = [bytes(f) for f in encode(Assign(spec, trace={"traceparent": "00-abc"}))]
    assert decode(frames).spec == spec
    runs = 50
    seconds = min(timeit.repeat(lambda: decode(frames), number=runs, repeat=5, timer=time.process_time)) / runs
    per_token_us = seconds * 1e6 / PROMPT_TOKENS
    print(f"ASSIGN of {PROMPT_TOKENS} tokens: {seconds * 1e6:.0f} µs CPU, {per_token_us:.3f} µs per prompt token")
    assert per_token_us <= MAX_US_PER_TOKEN
