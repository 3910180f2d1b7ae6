"""The gateway's configuration: one frozen dataclass tree whose settings are `loraserve gateway`'s flags
(`config_cli.py`), built in `main.py`, where `serve` adds what it reads from the model directory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loraserve.config_cli import setting
from loraserve.gateway.constraints import ConstraintConfig
from loraserve.gateway.failover import FailoverConfig
from loraserve.gateway.http.connections import ConnectionLimits
from loraserve.gateway.tls import TlsSettings
from loraserve.gateway.tokenizing import TokenizingConfig
from loraserve.gateway.tool_parsers import PARSERS, TOOL_CALL_PARSER_HELP
from loraserve.gateway.validation import Limits
from loraserve.model_config import DEFAULT_MAX_LORA_RANK
from loraserve.process import DRAIN_TIMEOUT_S
from loraserve.shared_defaults import SCHEDULER_ADDRESS, STORE_ADDRESS

MODEL_HELP = "model directory (tokenizer.json, config.json)"


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `loraserve gateway` runs with: its settings, and the served model's name and type."""

    bind: str = setting("127.0.0.1:50051", "public gRPC address")
    http_bind: str | None = setting(
        None, "also serve the OpenAI-compatible HTTP API here (e.g. 127.0.0.1:8000); unset: off"
    )
    http: ConnectionLimits = field(default_factory=ConnectionLimits)
    tool_call_parser: str | None = setting(None, TOOL_CALL_PARSER_HELP, choices=tuple(sorted(PARSERS)))
    auth_file: Path | None = setting(
        None,
        "TOML file of tenants, API key digests, scopes, quotas (reloaded on SIGHUP); unset: open, loopback only",
    )
    insecure_no_auth: bool = setting(
        False, "serve a non-loopback --bind without --auth-file (only where something else guards the port)"
    )
    tls: TlsSettings = field(default_factory=TlsSettings)
    scheduler: str = setting(SCHEDULER_ADDRESS, "the scheduler's gRPC address")
    store: str = setting(STORE_ADDRESS, "the adapter store's gRPC address")
    token_address: str = setting("tcp://127.0.0.1:7201", "ZMQ address the token sink binds")
    token_advertise: str | None = setting(None, "address workers push tokens to (default: --token-address)")
    max_context: int | None = setting(None, "default: the model's max positions")
    default_max_new_tokens: int = setting(Limits.default_max_new_tokens, "")
    max_lora_rank: int = setting(DEFAULT_MAX_LORA_RANK, "")
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    tokenizing: TokenizingConfig = field(default_factory=TokenizingConfig)
    constraints: ConstraintConfig = field(default_factory=ConstraintConfig)
    drain_timeout_s: float = setting(
        DRAIN_TIMEOUT_S, "on SIGTERM, seconds to let streams in flight finish before stopping", flag="--drain-timeout"
    )
    internal_timeout_s: float = 5.0  # calls to the scheduler and the store
    upload_timeout_s: float = 120.0  # an upload's relay to the store (or the client's deadline, if sooner)
    model_name: str = ""  # the served model's name (its directory's) and type (its config.json's): `serve` sets them
    model_type: str = ""
