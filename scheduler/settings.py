"""`loraserve scheduler`'s settings beyond its strategies' own, light enough for `loraserve up` to read."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from loraserve.config_cli import add_config_arguments, config_from_args, setting
from loraserve.scheduler.batch_share import BatchShareConfig
from loraserve.scheduler.config import POLICIES, AdaptiveConfig, ClusterConfig, FcfsConfig, PolicyConfig


@dataclass(frozen=True)
class SchedulerSettings:
    """`loraserve scheduler`'s settings: its addresses and the policy's common ones (defaults: PolicyConfig's).
    A strategy's own config dataclass adds its flags with `add_config_arguments` (`config_cli.py`)."""

    bind: str = setting("127.0.0.1:7100", "gRPC address gateways call")
    worker_address: str = setting("tcp://127.0.0.1:7101", "ZMQ address workers connect to")
    max_queue_length: int = setting(FcfsConfig.max_queue_length, "requests queued at most; more are refused")
    worker_timeout: float = setting(
        ClusterConfig.worker_timeout_s,
        "seconds without any message from a worker (it heartbeats every 0.25 s) before it is dropped (its requests "
        "fail over)",
    )
    stale_after: float = setting(
        ClusterConfig.stale_after_s,
        "seconds without a report (or in one step) after which nothing new is placed on a worker",
    )
    prefetch_depth: int = setting(FcfsConfig.prefetch_depth, "queued requests used to predict adapters")
    policy: str = setting(
        POLICIES[0],
        "scheduling policy: adaptive (cost model, multi-queue, VTC fairness, early refusal, migration, "
        "scored prefetch) or fcfs (first come first served, least-loaded worker with room); see docs/architecture.md",
        choices=POLICIES,
    )


# Settings SchedulerSettings carries under its own flag names (or that are not flags here).
POLICY_SKIP = frozenset({"max_queue_length", "prefetch_depth", "worker_timeout_s", "stale_after_s"})


def add_policy_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Flags for every setting of the cluster view, the batch shares and the adaptive strategy (fcfs has only
    the common ones)."""
    add_config_arguments(parser, ClusterConfig, skip=POLICY_SKIP)
    add_config_arguments(parser, BatchShareConfig)
    add_config_arguments(parser, AdaptiveConfig, skip=POLICY_SKIP)


def policy_config(args: argparse.Namespace) -> PolicyConfig:
    """The policy's configuration from `loraserve scheduler`'s parsed flags."""
    common = {
        "max_queue_length": _or(args.max_queue_length, FcfsConfig.max_queue_length),
        "prefetch_depth": _or(args.prefetch_depth, FcfsConfig.prefetch_depth),
    }
    cluster = {
        "worker_timeout_s": _or(args.worker_timeout, ClusterConfig.worker_timeout_s),
        "stale_after_s": _or(args.stale_after, ClusterConfig.stale_after_s),
    }
    return PolicyConfig(
        args.policy or POLICIES[0],
        cluster=config_from_args(ClusterConfig, args, **cluster),
        fcfs=FcfsConfig(**common),
        adaptive=config_from_args(AdaptiveConfig, args, **common),
        share=config_from_args(BatchShareConfig, args),
    )


def _or(value: object, default: object) -> object:
    """A setting the caller set, else its default (a test stack passes None for what it does not choose)."""
    return default if value is None else value
