"""`loraserve gateway`'s settings, light enough for `loraserve up` to read (no gateway code is imported)."""

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


@dataclass(frozen=True)
class GatewaySettings:
    """`loraserve gateway`'s settings (and the model's); `serve` makes the gateway's configurations of them."""

    bind: str = setting("127.0.0.1:50051", "public gRPC address")
    http_bind: str | None = setting(
        None, "also serve the OpenAI-compatible HTTP API here (e.g. 127.0.0.1:8000); unset: off"
    )
    http_max_connections: int = setting(
        ConnectionLimits.max_connections, "open HTTP connections at most; one more is answered 503 and closed"
    )
    http_header_timeout: float = setting(
        ConnectionLimits.header_timeout_s, "seconds an HTTP client has to send a whole request head (else 408, closed)"
    )
    http_body_timeout: float = setting(
        ConnectionLimits.body_timeout_s,
        "seconds an HTTP client has to send a whole request body after its head (else 408, closed)",
    )
    http_keep_alive: float = setting(
        ConnectionLimits.keep_alive_s,
        "seconds an idle HTTP keep-alive connection is kept open (longer than clients' pools keep theirs)",
    )
    tool_call_parser: str | None = setting(None, TOOL_CALL_PARSER_HELP, choices=tuple(sorted(PARSERS)))
    auth_file: Path | None = setting(
        None,
        "TOML file of tenants, API key digests, scopes, quotas (reloaded on SIGHUP); unset: open, loopback only",
    )
    insecure_no_auth: bool = setting(
        False, "serve a non-loopback --bind without --auth-file (only where something else guards the port)"
    )
    tls: TlsSettings = field(default_factory=TlsSettings)
    scheduler: str = setting("127.0.0.1:7100", "the scheduler's gRPC address")
    store: str = setting("127.0.0.1:7300", "the adapter store's gRPC address")
    token_address: str = setting("tcp://127.0.0.1:7201", "ZMQ address the token sink binds")
    token_advertise: str | None = setting(None, "address workers push tokens to (default: --token-address)")
    max_context: int | None = setting(None, "default: the model's max positions")
    default_max_new_tokens: int = setting(Limits.default_max_new_tokens, "")
    max_lora_rank: int = setting(DEFAULT_MAX_LORA_RANK, "")
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    tokenizing: TokenizingConfig = field(default_factory=TokenizingConfig)
    constraints: ConstraintConfig = field(default_factory=ConstraintConfig)
    drain_timeout: float = setting(
        DRAIN_TIMEOUT_S, "on SIGTERM, seconds to let streams in flight finish before stopping"
    )


MODEL_HELP = "model directory (tokenizer.json, config.json)"
