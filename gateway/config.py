"""The gateway's settings, one frozen dataclass built from the flags in `main.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.gateway.failover import FailoverConfig


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    model_type: str
    max_lora_rank: int
    internal_timeout_s: float = 5.0  # calls to the scheduler and the store
    upload_timeout_s: float = 120.0  # an upload's relay to the store (or the client's deadline, if sooner)
    failover: FailoverConfig = field(default_factory=FailoverConfig)
