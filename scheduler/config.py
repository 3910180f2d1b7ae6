"""The scheduler's configuration: its addresses, and the policy's settings (the cluster view's and each strategy's).

    SchedulerConfig   everything `loraserve scheduler` runs with: where it listens, and the policy's PolicyConfig
    PolicyConfig      which strategy runs (`--policy`), with every config below
    ClusterConfig     when a worker counts as stale or dead, how many may register, how many dropped ones are remembered
    FcfsConfig        the `fcfs` strategy: the queue's bound and how far prediction looks ahead
    AdaptiveConfig    the `adaptive` strategy: FCFS's settings and those of the parts in this package
    BatchShareConfig  the batch slots one client request and one tenant may hold (`batch_share.py`)

Each setting has one default, here, and its help in the field's metadata; the fields are the flags
(`config_cli.py`: the fcfs and adaptive strategies' common settings are one flag each).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError
from loraserve.scheduler.batch_share import BatchShareConfig
from loraserve.scheduler.cost_model import StepCost
from loraserve.scheduler.queues import SizeClasses
from loraserve.shared_defaults import PREFETCH_DEPTH, SCHEDULER_ADDRESS, SCHEDULER_WORKER_ADDRESS

POLICIES = ("adaptive", "fcfs")  # the first is the default


def _check(ok: bool, config: object) -> None:
    if not ok:
        raise InvalidConfigError(f"invalid scheduler policy config {config}")


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster view's settings (`cluster.py`)."""

    # Liveness is "the process answers", not "its last step was short": a worker's I/O thread sends a heartbeat
    # every 0.25 s whatever its step loop does, so a CPU-starved worker in a long step stays (a killed one is
    # seen at once by the socket monitor, `loop.py`). 5 s: a stopped process, or one whose I/O thread cannot
    # run for that long even on a loaded 2-core machine.
    worker_timeout_s: float = setting(
        5.0,
        "seconds without any message from a worker (heartbeat or report) before it is dropped (its requests "
        "fail over); workers send a heartbeat every 0.25 s from their I/O thread, however long their step",
        flag="--worker-timeout",
    )
    stale_after_s: float = setting(
        0.75,
        "seconds without a report (sent after each step) or in one step after which nothing new is placed on a "
        "worker (at most --worker-timeout)",
        flag="--stale-after",
    )
    max_zombies: int = setting(1024, "dropped workers remembered, to recognise one that comes back")
    max_workers: int = setting(1024, "workers registered at once; a report from one more worker id is refused")

    def __post_init__(self) -> None:
        _check(self.worker_timeout_s > 0 and self.stale_after_s > 0 and self.max_zombies >= 0, self)
        _check(self.max_workers >= 1, self)

    @property
    def fresh_s(self) -> float:
        """A worker whose last report is older than this gets nothing new."""
        return min(self.stale_after_s, self.worker_timeout_s)


@dataclass(frozen=True)
class FcfsConfig:
    """The `fcfs` strategy's settings (`fcfs.py`); the `adaptive` one has them too."""

    max_queue_length: int = setting(1024, "requests the scheduler queues; more are refused (RESOURCE_EXHAUSTED)")
    prefetch_depth: int = setting(PREFETCH_DEPTH, "queued requests looked at when predicting adapters")

    def __post_init__(self) -> None:
        _check(self.max_queue_length >= 1 and self.prefetch_depth >= 0, self)


@dataclass(frozen=True)
class AdaptiveConfig(FcfsConfig):
    """The `adaptive` strategy's settings (`adaptive/strategy.py` and the parts it composes)."""

    starvation_s: float = setting(5.0, "a request queued this long goes first and is overtaken no more")
    size_classes: SizeClasses = field(default_factory=SizeClasses)  # Chameleon's weighted sizes and class bounds
    vtc_input_weight: float = setting(1.0, "VTC fairness charge per prompt token")
    vtc_output_weight: float = setting(2.0, "VTC fairness charge per output token (budgeted)")
    flood_share: float = setting(
        0.5, "a tenant holding this share of a queue 3/4 full is refused (others may still come)"
    )
    # On the real stack (docs/benchmarks.md, "Scheduling") 0.5 left a flooded victim's p99 TTFT at 2.2x its calm
    # value (steps grow with the batch on the emulated CPU device); 0.1 keeps it at 1.2x.
    flooder_slot_share: float = setting(
        0.1, "of an equal split of batch slots, what the largest-backlog tenant may hold while others are active"
    )
    output_fraction: float = setting(0.5, "expected output as a share of max_new_tokens (cost and admission)")
    step_cost: StepCost = field(default_factory=StepCost)  # the step-time model's starting coefficients
    adapter_load_s: float = setting(0.05, "seconds a placement costs where the request's adapter is not resident")
    migrate_after_s: float = setting(2.0, "a request waiting on its worker this long may move (0: never)")
    max_recompute_tokens: int = setting(
        256, "a running request moves (by recompute) only if it has computed at most this many tokens"
    )
    popularity_half_life_s: float = setting(30.0, "half-life of the per-adapter EWMA arrival rate")
    prefetch_horizon_s: float = setting(2.0, "popularity scores: the chance of a request within this many seconds")
    min_prefetch_score: float = setting(0.2, "popular adapters less likely than this are not prefetched")
    predict_interval_s: float = setting(0.02, "prefetch hints are planned at most this often (seconds)")
    migrate_interval_s: float = setting(0.1, "migrations are planned at most this often (seconds)")
    return_window_s: float = setting(
        10.0, "an adapter asked for again this soon after a request for it ended has 'returned'"
    )
    hold_slo_share: float = setting(
        0.5, "a request held for its adapter's prefetch waits at most this share of its TTFT target"
    )
    # Off: in the scheduling benchmark a 40 ms hold raised the prefetch hit rate (0.03 -> 0.35 on `popularity`) but
    # worsened TTFT everywhere (popularity p99 34 -> 54 ms), since the worker fetches on ASSIGN anyway.
    prefetch_hold_s: float = setting(
        0.0, "a request whose adapter its busy worker lacks may wait this long for a prefetch there (0: off)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_recompute_tokens < 0:
            raise InvalidConfigError(f"max_recompute_tokens must be >= 0, got {self.max_recompute_tokens}")
        _check(self.starvation_s > 0 and self.adapter_load_s >= 0 and self.migrate_after_s >= 0, self)
        _check(self.prefetch_hold_s >= 0 and self.vtc_input_weight >= 0 and self.vtc_output_weight >= 0, self)
        _check(0 < self.flood_share <= 1 and 0 < self.output_fraction <= 1 and 0 < self.flooder_slot_share <= 1, self)
        _check(self.popularity_half_life_s > 0 and self.prefetch_horizon_s > 0, self)
        _check(0 <= self.min_prefetch_score <= 1 and self.return_window_s > 0, self)
        _check(self.predict_interval_s >= 0 and self.migrate_interval_s >= 0, self)


@dataclass(frozen=True)
class PolicyConfig:
    """Which strategy the policy runs, and the settings of each part. `policy` only picks the strategy
    that is built (`SchedulerPolicy`); nothing else tests it."""

    policy: str = setting(
        POLICIES[0],
        "scheduling policy: adaptive (cost model, multi-queue, VTC fairness, early refusal, migration, "
        "scored prefetch) or fcfs (first come first served, least-loaded worker with room); see docs/architecture.md",
        choices=POLICIES,
    )
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the cluster view's settings
    fcfs: FcfsConfig = field(default_factory=FcfsConfig)  # the fcfs strategy's settings
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)  # the adaptive strategy's (fcfs's too)
    share: BatchShareConfig = field(default_factory=BatchShareConfig)  # batch shares of a client request and a tenant

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidConfigError(f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(POLICIES)}")

    @classmethod
    def of(cls, policy: str = POLICIES[0], **settings: Any) -> PolicyConfig:
        """`policy` with settings named by field: a cluster setting goes to the cluster view, any other to
        each strategy config that has it (the shared ones, such as max_queue_length, to both)."""
        config = cls(policy)
        parts = {"cluster": config.cluster, "fcfs": config.fcfs, "adaptive": config.adaptive, "share": config.share}
        taken: set[str] = set()
        for name, part in parts.items():
            mine = {k: v for k, v in settings.items() if k in {f.name for f in fields(part)}}
            if mine:
                parts[name] = replace(part, **mine)
                taken |= mine.keys()
        unknown = settings.keys() - taken
        if unknown:
            raise InvalidConfigError(f"unknown scheduler policy settings: {', '.join(sorted(unknown))}")
        return cls(policy, **parts)


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything `loraserve scheduler` runs with: its addresses and the policy's settings."""

    bind: str = setting(SCHEDULER_ADDRESS, "gRPC address gateways call")
    worker_address: str = setting(SCHEDULER_WORKER_ADDRESS, "ZMQ address workers connect to")
    policy: PolicyConfig = field(default_factory=PolicyConfig)
