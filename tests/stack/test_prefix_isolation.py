"""Prefix caching leaks nothing across tenants, measured as an attacker would: by time to first token.

A real stack, tenants `a` and `b`. Each trial draws a fresh ~420-token prompt P and a prompt Q nobody
sent of exactly P's token count (P's words after the first, shuffled); `a` sends P, then `b` sends P
(would be fast if `a`'s cached KV were shared) and Q (cold), in alternating order, and `a` sends P
again (a hit: the positive control, which shows the measurement can see a cached prefix at all). Over
the trials, `b`'s TTFT for P must be as far from `a`'s hit as a cold prompt is, and as close to the
cold one as the trials' own spread: the medians of the paired differences (after - cold) must stay
within a quarter of the hit's effect (cold - hit).

Q has P's length because the length alone is visible: the CPU math libraries keep kernels per shape,
so a prefill of a length that just ran starts a few milliseconds sooner whatever its tokens (with Q of
another length, after - cold was -2 to -6 ms against a 16-21 ms hit effect on the demo model; with
P's length, -0.5 to +1.6 ms). That is the prompt's length, not its content (docs/security.md).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time

import pytest
from stack import LocalStack

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.v1 import gateway_pb2

pytestmark = pytest.mark.slow
KEYS = {name: f"key-of-{name}-0123456789" for name in ("a", "b")}
WORDS = "the quiet king finds my little boat and green queen waits across this gentle tree".split()  # noqa: SIM905
TRIALS = 14


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    auth = tmp_path_factory.mktemp("auth") / "auth.toml"
    auth.write_text(
        "".join(
            f'[[tenants]]\nname = "{name}"\nscopes = ["generate"]\n'
            f'api_key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n\n'
            for name, key in KEYS.items()
        )
    )
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, auth_file=str(auth)).start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


def _ttft(stack, tenant: str, text: str) -> tuple[float, int, int]:
    """(seconds until the first token reached the client, prompt tokens the worker found cached, prompt tokens)."""
    request = gateway_pb2.GenerateRequest(text=text, max_new_tokens=2)
    started, first, usage = time.perf_counter(), None, None
    for event in stack.api.GenerateStream(request, timeout=60, metadata=(("authorization", f"Bearer {KEYS[tenant]}"),)):
        if event.HasField("chunk") and first is None:
            first = time.perf_counter() - started
        if event.HasField("summary"):
            usage = event.summary.usage
    assert first is not None and usage is not None
    return first, usage.cached_tokens, usage.prompt_tokens


def test_another_tenants_prompt_is_as_cold_as_one_nobody_sent(stack):
    rng = random.Random(11)

    def prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(280))

    def same_length(p: str) -> str:  # P's words after the first, shuffled: another prompt of P's token count
        first, *rest = p.split()
        return " ".join([first, *rng.sample(rest, len(rest))])

    _ttft(stack, "a", prompt())  # warm the path (connections, first allocations): not measured
    after, cold, hit = [], [], []
    for trial in range(TRIALS):
        p = prompt()
        q = same_length(p)
        _ttft(stack, "a", p)
        b_side = [("after", p), ("cold", q)] if trial % 2 else [("cold", q), ("after", p)]
        lengths = set()
        for kind, text in b_side:
            seconds, cached, length = _ttft(stack, "b", text)
            assert cached == 0, (kind, cached)  # the structural guarantee: nothing of `a`'s is found
            (after if kind == "after" else cold).append(seconds)
            lengths.add(length)
        assert len(lengths) == 1, lengths  # P and Q differ in their tokens alone
        seconds, cached, _ = _ttft(stack, "a", p)
        assert cached > 0
        hit.append(seconds)
    effect = statistics.median(c - h for c, h in zip(cold, hit, strict=True))
    leak = statistics.median(a - c for a, c in zip(after, cold, strict=True))
    assert effect > 0, (cold, hit)  # the positive control: a hit is visibly faster
    assert abs(leak) < 0.25 * effect, {"leak_s": leak, "effect_s": effect, "after": after, "cold": cold, "hit": hit}
