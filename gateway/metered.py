"""Tokenizer calls metered as generations are: `Tokenize` and `Detokenize` (gRPC), `/tokenize` and
`/detokenize` (HTTP).

Each call is authenticated (UNAVAILABLE for everyone while draining), needs the scope `generate`,
holds one of its tenant's in-flight slots while it runs (`TenantSlots`, the `max_concurrent` that
generations count against: over it, RESOURCE_EXHAUSTED with a retry hint), and is counted in
`loraserve_gateway_tokenizer_requests_total{operation,code,tenant}` by how it ended.

Token quotas (`tokens_per_minute`) do not apply: the scheduler meters the tokens workers compute,
and a tokenizer call reaches no worker; what it costs (gateway CPU) is bounded by the slots, the
tokenizer pool's queue and the byte bound (`gateway/tokenizing.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from loraserve.gateway import metrics
from loraserve.gateway.auth import Principal
from loraserve.gateway.tenants import Scope

if TYPE_CHECKING:
    from loraserve.gateway.core import GenerationCore


@asynccontextmanager
async def metered(core: GenerationCore, metadata: dict[str, str], operation: str) -> AsyncIterator[Principal]:
    """The caller of one `operation` call ("tokenize", "detokenize"), admitted for as long as the block runs."""
    code, tenant, admitted = "OK", metrics.UNAUTHENTICATED, False
    try:
        principal = core.authenticate(metadata)
        tenant = principal.tenant
        principal.require(Scope.GENERATE, operation)
        core.slots.admit(tenant, principal.limits)
        admitted = True
        yield principal
    except BaseException as e:
        code = metrics.outcome(e)
        raise
    finally:
        if admitted:
            core.slots.release(tenant)
        metrics.TOKENIZER_REQUESTS.labels(operation, code, tenant).inc()
