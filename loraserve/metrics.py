"""Prometheus metrics: every role can serve its process's registry over HTTP.

A role started with `--metrics-port P` answers `GET http://127.0.0.1:P/metrics` (bind another
host with `--metrics-host`) in Prometheus' text format: the role's own `loraserve_*` metrics
beside prometheus-client's process and Python collectors. Port 0, the default, serves nothing.
The metrics themselves are defined next to the code that updates them (gateway/metrics.py,
worker/metrics.py, scheduler/metrics.py).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from loraserve.config_cli import setting

METRICS_OFF = 0  # a metrics port of 0: no Prometheus endpoint (a role's, or `loraserve up`'s for every role)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricsSettings:
    """Where a role serves its Prometheus metrics."""

    metrics_port: int = setting(METRICS_OFF, "serve Prometheus metrics on this port at /metrics (0: off)")
    metrics_host: str = setting("127.0.0.1", "address the metrics endpoint binds")


def serve_metrics(args: argparse.Namespace, role: str) -> None:
    """Start the metrics endpoint in a daemon thread when `--metrics-port` asks for one; a port that
    cannot be bound is an InvalidConfigError."""
    if not args.metrics_port:
        return
    from prometheus_client import start_http_server

    from loraserve.errors import InvalidConfigError

    try:
        start_http_server(args.metrics_port, addr=args.metrics_host)
    except OSError as e:  # a busy port or an address this host does not have
        raise InvalidConfigError(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {e}") from e
    log.info("%s metrics on http://%s:%d/metrics", role, args.metrics_host, args.metrics_port)
