"""The gateway's Prometheus metrics (served when the gateway runs with --metrics-port).

No adapter labels: with thousands of adapters they would explode the series count; per-adapter
figures are in the traces. Requests carry a `tenant` label, which stays bounded: tenants come from
the auth file, and every caller without a valid key counts as one value, "unauthenticated".
"""

from __future__ import annotations

import asyncio

from prometheus_client import Counter, Gauge, Histogram

from loraserve.errors import LoraserveError

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

UNAUTHENTICATED = "unauthenticated"  # the tenant label of callers without a valid key
REQUESTS = Counter(
    "loraserve_gateway_requests",
    "Generation requests by outcome (OK, or the gRPC status they ended with) and tenant",
    ["code", "tenant"],
)
IN_FLIGHT = Gauge("loraserve_gateway_requests_in_flight", "Generation requests being served now")
TOKENIZER_REQUESTS = Counter(
    "loraserve_gateway_tokenizer_requests",
    "Tokenize and detokenize calls (gRPC and HTTP) by operation, outcome (as REQUESTS) and tenant",
    ["operation", "code", "tenant"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "loraserve_gateway_time_to_first_token_seconds",
    "Arrival at the gateway to the first token",
    buckets=LATENCY_BUCKETS,
)
REQUEST_DURATION = Histogram(
    "loraserve_gateway_request_duration_seconds",
    "Arrival to the final message, completed requests",
    buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("loraserve_gateway_prompt_tokens", "Prompt tokens of completed requests")
OUTPUT_TOKENS = Counter("loraserve_gateway_output_tokens", "Tokens generated for completed requests")
FAILOVERS = Counter("loraserve_gateway_failovers", "Times a request lost its worker and was continued on another one")
HTTP_CONNECTIONS_REFUSED = Counter(
    "loraserve_gateway_http_connections_refused",
    "HTTP connections closed at --http-max-connections: a new one answered 503 when every open one was busy with "
    "a request (full), or, to make room for a new one, the open one longest without a first request (answered "
    "503) or else the one idle longest between requests (closed with nothing sent) (evicted)",
    ["why"],
)
HTTP_CONNECTIONS_TIMED_OUT = Counter(
    "loraserve_gateway_http_connections_timed_out",
    "HTTP connections closed because the client was too slow to send a request head or body",
    ["waiting_for"],
)


def outcome(error: BaseException) -> str:
    """The status code name a request that raised `error` ends with."""
    if isinstance(error, LoraserveError):
        return error.status
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    return "INTERNAL"
