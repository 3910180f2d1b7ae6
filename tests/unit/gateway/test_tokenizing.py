"""The gateway's tokenizer pool (`gateway/tokenizing.py`), on the demo model's real tokenizer.

- The byte bound: a text of more UTF-8 bytes than the context length times the longest token's
  bytes is refused naming its field, before any tokenizing; a text that many tokens could hold is not.
  The bound is sound: no text over it tokenizes to the context length or fewer tokens.
- Encoding in the pool leaves the event loop running (HF `tokenizers` releases the GIL in
  `encode_batch`, not in `encode`: measured here on a 1 MiB text).
- The queue is bounded: one job more than threads + queue is refused RESOURCE_EXHAUSTED with a retry
  hint, and every job's place is given back however it ends (done, failed, or its caller cancelled).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidRequestError
from loraserve.gateway.chat_template import ChatTemplate
from loraserve.gateway.tokenizing import TokenizerBusyError, Tokenizing, TokenizingConfig
from loraserve.tokenizer import Tokenizer

TOKENIZER = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
CONTEXT = 512  # the demo model's
MIB = 1 << 20


def test_the_byte_bound_refuses_a_text_too_long_to_fit_naming_its_field_and_the_bound():
    pool = Tokenizing(TOKENIZER, CONTEXT)
    bound = pool.max_text_bytes
    assert pool.longest_token_bytes == 8 and bound == CONTEXT * 8  # "Ġsleeps": 8 bytes as a token string
    pool.check_fits("a" * bound, "prompt.text")
    with pytest.raises(InvalidRequestError) as refused:
        pool.check_fits("a" * (bound + 1), "prompt.text")
    assert refused.value.field == "prompt.text"
    assert f"is {bound + 1} bytes" in str(refused.value) and f"over {bound} bytes" in str(refused.value)
    assert f"context length of {CONTEXT} tokens" in str(refused.value)
    with pytest.raises(InvalidRequestError, match=f"is {bound + 2} bytes"):  # bytes, not characters
        pool.check_fits("é" * (bound // 2 + 1), "messages")
    with pytest.raises(InvalidRequestError, match="messages: is"):
        asyncio.run(pool.encode("the quiet king " * (MIB // 15), "messages"))
    pool.close()


def test_no_text_over_the_byte_bound_fits_the_context():
    """The bound refuses only texts the token count would refuse too: over n x longest bytes, more than n tokens."""
    pool = Tokenizing(TOKENIZER, 16)
    rng = random.Random(7)
    words = [TOKENIZER.decode([i], skip_special_tokens=False) for i in range(TOKENIZER.vocab_size)]
    for _ in range(200):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        if len(text.encode()) > pool.max_text_bytes:
            assert len(TOKENIZER.encode(text, add_special_tokens=False)) > 16, text


def test_tokenizing_in_the_pool_leaves_the_event_loop_running():
    text = "".join(random.Random(0).choice("abcdefghij klmnop.,") for _ in range(MIB))  # ~1 s to encode here
    pool = Tokenizing(TOKENIZER, MIB)  # a context that holds it: the bound does not refuse it

    async def scenario() -> tuple[list[int], float]:
        gaps, done = [0.0], asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticking = asyncio.create_task(ticker())
        ids = await pool.encode(text, "prompt.text", add_special_tokens=False)
        done.set()
        await ticking
        return ids, max(gaps)

    started = time.perf_counter()
    ids, worst_gap = asyncio.run(scenario())
    took = time.perf_counter() - started
    assert ids == TOKENIZER.encode(text, add_special_tokens=False)
    assert worst_gap < max(0.25, took / 3), (worst_gap, took)  # inline, the loop would stall for all of it
    pool.close()


def test_decoding_and_rendering_run_in_the_pool_with_the_same_results():
    pool = Tokenizing(TOKENIZER, CONTEXT)
    template = ChatTemplate.from_model_dir(DEMO_MODEL_DIR)
    messages = [{"role": "user", "content": "the quiet king"}]

    async def scenario():
        ids, strings = await pool.encode_with_strings("the quiet king", "prompt")
        return ids, strings, await pool.decode(ids), await pool.render(template, messages)

    ids, strings, text, rendered = asyncio.run(scenario())
    assert ids == TOKENIZER.encode("the quiet king") and strings == TOKENIZER.token_strings(ids)
    assert text == TOKENIZER.decode(ids) and rendered == template.render(messages)
    assert pool.jobs == 0
    pool.close()


def test_the_queue_is_bounded_and_every_job_gives_its_place_back():
    pool = Tokenizing(TOKENIZER, CONTEXT, TokenizingConfig(tokenizer_threads=1, tokenizer_queue=1))
    release = threading.Event()

    async def scenario() -> None:
        running = asyncio.ensure_future(pool._run(release.wait, 10))  # holds the one thread
        queued = asyncio.ensure_future(pool.decode([5, 6]))  # waits for it
        await asyncio.sleep(0.05)
        assert pool.jobs == 2
        with pytest.raises(TokenizerBusyError) as busy:
            await pool.decode([5])
        assert busy.value.status == "RESOURCE_EXHAUSTED" and busy.value.retry_after_ms == 1000
        assert "tokenizer is busy" in str(busy.value)
        queued.cancel()  # a caller that leaves frees its place at once
        await asyncio.gather(queued, return_exceptions=True)
        assert pool.jobs == 1
        late = asyncio.ensure_future(pool.decode([7]))
        release.set()
        assert await running is True and await late == TOKENIZER.decode([7])
        with pytest.raises(ValueError):  # a job that fails in its thread gives its place back too
            await pool._run(int, "not a number")
        assert pool.jobs == 0

    asyncio.run(scenario())
    pool.close()


def test_the_pool_settings_are_checked():
    with pytest.raises(Exception, match="--tokenizer-threads"):
        TokenizingConfig(tokenizer_threads=0)
    with pytest.raises(Exception, match="--tokenizer-queue"):
        TokenizingConfig(tokenizer_queue=-1)


def test_concurrent_encodes_of_one_text_share_one_job():
    """A body's prompt is encoded once for all its choices: n callers at once take one place in the pool."""
    pool = Tokenizing(TOKENIZER, CONTEXT, TokenizingConfig(tokenizer_threads=1, tokenizer_queue=0))
    text = "the quiet king " * 200

    async def many() -> list[list[int]]:
        return await asyncio.gather(*(pool.encode(text, "prompt", add_special_tokens=False) for _ in range(64)))

    try:
        results = asyncio.run(many())  # a second job would be refused: 1 thread, no queue
        assert all(r == TOKENIZER.encode(text, add_special_tokens=False) for r in results)
        assert len({id(r) for r in results}) == 64  # each caller its own list
    finally:
        pool.close()


def _tokenizer_with(model: dict, normalizer: dict | None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    spec = json.loads(TOKENIZER.to_json())
    spec["model"].update(model)
    spec["normalizer"] = normalizer
    return Tokenizer(HFTokenizer.from_str(json.dumps(spec)), TOKENIZER.eos_token_ids, TOKENIZER.bos_token_id)


@pytest.mark.parametrize(
    ("model", "normalizer", "bound"),
    [
        ({}, None, 8),  # the demo's byte-level BPE
        ({}, {"type": "NFC"}, 24),  # composing: up to 3 input bytes per byte
        ({}, {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "NFKC"}]}, 24),
        ({}, {"type": "StripAccents"}, None),  # deletes combining marks: any length
        ({"unk_token": "<|endoftext|>", "byte_fallback": False}, None, None),  # one unknown token, any length
    ],
)
def test_the_byte_bound_holds_only_where_the_tokenizer_bounds_a_token_s_text(model, normalizer, bound):
    tokenizer = _tokenizer_with(model, normalizer)
    assert tokenizer.longest_token_bytes() == bound
    pool = Tokenizing(tokenizer, CONTEXT)
    try:
        pool.check_fits("a" * (MIB if bound is None else CONTEXT * bound), "prompt")  # never refused unbounded
    finally:
        pool.close()
