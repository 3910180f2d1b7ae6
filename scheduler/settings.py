"""`loraserve scheduler`'s settings beyond its strategies' own, light enough for `loraserve up` to read."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.config_cli import setting
from loraserve.scheduler.policy import POLICIES, PolicyConfig


@dataclass(frozen=True)
class SchedulerSettings:
    """`loraserve scheduler`'s settings: its addresses and the policy's common ones (defaults: PolicyConfig's).
    A strategy's own config dataclass adds its flags with `add_config_arguments` (`config_cli.py`)."""

    bind: str = setting("127.0.0.1:7100", "gRPC address gateways call")
    worker_address: str = setting("tcp://127.0.0.1:7101", "ZMQ address workers connect to")
    max_queue_length: int = setting(PolicyConfig.max_queue_length, "requests queued at most; more are refused")
    worker_timeout: float = setting(
        PolicyConfig.worker_timeout_s, "seconds without a report before a worker is dropped (its requests fail over)"
    )
    stale_after: float = setting(
        PolicyConfig.stale_after_s, "seconds without a report after which nothing new is placed on a worker"
    )
    prefetch_depth: int = setting(PolicyConfig.prefetch_depth, "queued requests used to predict adapters")
    policy: str = setting(
        PolicyConfig.policy,
        "scheduling policy: adaptive (cost model, multi-queue, VTC fairness, early refusal, migration, "
        "scored prefetch) or fcfs (first come first served, busiest worker); see docs/architecture.md",
        choices=POLICIES,
    )
