"""The peer suite's figures from what the client saw: per run, across runs, and the targets. Pure.

Per run: output tokens/s (tokens over the run's wall time), TTFT and ITL p50/p99, the server's CPU
seconds per output token. Across runs: each system's median tokens/s per pairing, and greedy
agreement — the fraction of requests that got the same tokens from both systems, beside each
system's agreement with itself across its timed runs (batching may change a near-tie).

Agreement compares tokens, not texts: the texts of a random model differ where its byte-level tokens
leave UTF-8 incomplete, with the same tokens underneath — vLLM holds back a trailing partial
character that loraserve sends as U+FFFD, and vLLM's incremental detokenizer puts text of a prompt
that ends mid-character into the output. Nor are the logprobs' token texts comparable as sent: vLLM
gives a byte token the characters it completes in context, loraserve each token's text alone. So
vLLM's tokens are its ids (`return_token_ids`), decoded one by one as loraserve names its tokens
(the suite does that), and both sides' texts lose their U+FFFD replacement characters: two different
lone bytes at one place count as the same — the next tokens, which see that byte, would differ. The
identical-text fraction is reported beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from loraserve.bench.common.results import judged, target
from loraserve.bench.common.stats import quantile, ratio
from loraserve.bench.suites.peer.client import Completion
from loraserve.bench.suites.peer.plan import Run

BASE_TARGET = 1.0  # loraserve base >= 1.0 x vLLM's compiled base
LORA_TARGET = 0.9  # loraserve with the adapters >= 0.9 x vLLM's compiled base
AGREEMENT_TARGET = 1.0


def run_record(run: Run, completions: list[Completion], seconds: float, cpu_s: float | None, max_tokens: int) -> dict:
    """One run's record. Tokens are the usage's count where the server sent one, else max_tokens
    (ignore_eos makes every request generate exactly that many)."""
    good = [c for c in completions if c.error is None]
    tokens = sum(c.tokens if c.tokens is not None else max_tokens for c in good)
    ttft = [c.ttft_s for c in good if c.ttft_s is not None]
    itl = [gap for c in good for gap in c.itl_s]
    errors = [c.error for c in completions if c.error is not None]
    return {
        "pairing": run.pairing,
        "system": run.system,
        "repeat": run.repeat,
        "requests": len(completions),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 and good else None,
        "ttft_p50_s": quantile(ttft, 0.5, 4),
        "ttft_p99_s": quantile(ttft, 0.99, 4),
        "itl_p50_s": quantile(itl, 0.5, 5),
        "itl_p99_s": quantile(itl, 0.99, 5),
        "server_cpu_s": None if cpu_s is None else round(cpu_s, 3),
        "cpu_s_per_token": round(cpu_s / tokens, 6) if cpu_s is not None and tokens else None,
    }


def median_tokens_per_s(records: Sequence[dict], pairing: str, system: str) -> float | None:
    """The median tokens/s of `system`'s error-free runs in `pairing`; None when it has none. A record
    of a failure (`error`: the server did not install, start, or stay up) counts as no run."""
    values = [
        r["tokens_per_s"]
        for r in records
        if r["pairing"] == pairing and r["system"] == system and not r.get("errors") and r.get("tokens_per_s")
    ]
    return round(statistics.median(values), 2) if values else None


def canonical_tokens(token_texts: Sequence[str]) -> tuple[str, ...]:
    """Tokens as agreement compares them: each one's own text without U+FFFD."""
    return tuple(t.replace("\ufffd", "") for t in token_texts)


Output = str | Sequence[str] | None  # a request's text, or its tokens; None: it failed


def agreement(a: Sequence[Output], b: Sequence[Output], names: tuple[str, str] = ("a", "b"), examples: int = 3) -> dict:
    """How many requests got the same output (text or tokens) from both sides (None: the request
    failed there, which never agrees); the mean fraction of the output the two share from its start;
    and the first `examples` differing requests, each with both outputs (keyed by `names`) from the
    first difference (`at`) on."""
    if len(a) != len(b):
        raise ValueError(f"different request counts: {len(a)} and {len(b)}")
    same = sum(x is not None and x == y for x, y in zip(a, b, strict=True))
    shared = [_common_prefix(x, y) / max(len(x), len(y), 1) for x, y in zip(a, b, strict=True) if x and y]
    differ = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y and len(differ) < examples:
            at = _common_prefix(x or "", y or "")
            tails = [None if t is None else t[at:] for t in (x, y)]
            differ.append({"request": i, "at": at, names[0]: tails[0], names[1]: tails[1]})
    return {
        "requests": len(a),
        "identical": same,
        "fraction": round(same / len(a), 4) if a else None,
        "mean_common_prefix": round(statistics.mean(shared), 4) if shared else None,
        "differences": differ,
    }


def self_agreement(runs: Sequence[Sequence[Output]]) -> float | None:
    """The fraction of requests whose output is the same in every one of a system's runs."""
    if len(runs) < 2:
        return None
    same = sum(all(t is not None and t == texts[0] for t in texts) for texts in zip(*runs, strict=True))
    return round(same / len(runs[0]), 4)


def _common_prefix(x: str | Sequence[str], y: str | Sequence[str]) -> int:
    return next((i for i, (cx, cy) in enumerate(zip(x, y, strict=False)) if cx != cy), min(len(x), len(y)))


def targets(records: Sequence[dict], agreements: dict[str, dict], adapters: int) -> list[dict]:
    """The suite's targets. Any figure that vLLM did not give (not installed, not started, failed)
    is None and its target is not met."""
    vllm_base = median_tokens_per_s(records, "base", "vllm")
    base = ratio(median_tokens_per_s(records, "base", "loraserve"), vllm_base, 3)
    lora = ratio(median_tokens_per_s(records, "lora", "loraserve"), vllm_base, 3)
    rows = [
        ("loraserve base / vLLM compiled base (tokens/s, median of runs)", BASE_TARGET, base),
        (f"loraserve with {adapters} adapters / vLLM compiled base (tokens/s, median of runs)", LORA_TARGET, lora),
    ]
    out = [judged(n, f">= {goal}", v) for n, goal, v in rows]
    for pairing in ("base", "lora"):
        value = (agreements.get(pairing) or {}).get("fraction")
        name = f"greedy agreement with vLLM, {pairing} pairing (requests with identical tokens)"
        out.append(target(name, "100 %", value, value is not None and value >= AGREEMENT_TARGET))
    return out
