"""The audit log: one line per adapter administration or key reload, on the `loraserve.audit` logger.

Each line names the action, the tenant that asked ("unauthenticated" when no valid key came with
it), the adapter (its store name: `TENANT~NAME`, or a public name), the version and the outcome (OK
or the gRPC status it failed with). Route the logger to a handler of its own to keep the trail
apart from operational logs. Keys, prompts and weights never appear.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("loraserve.audit")


@dataclass
class AuditRecord:
    """What an action is about, filled in as the handler learns it."""

    action: str
    tenant: str = "unauthenticated"
    adapter: str = "-"
    version: int | None = None


def audit(record: AuditRecord, outcome: str = "OK") -> None:
    """Record one administrative action and how it ended."""
    log.info(
        "action=%s tenant=%s adapter=%s version=%s outcome=%s",
        record.action,
        record.tenant,
        record.adapter,
        record.version if record.version is not None else "-",
        outcome,
    )


@contextmanager
def audited(action: str) -> Iterator[AuditRecord]:
    """Log the action in the `with` block once it ends, OK or with the status of what it raised."""
    record = AuditRecord(action)
    try:
        yield record
    except BaseException as e:
        cancelled = isinstance(e, asyncio.CancelledError | GeneratorExit)
        audit(record, "CANCELLED" if cancelled else getattr(e, "status", "INTERNAL"))
        raise
    audit(record)
