"""`AdapterFetcher`: a worker's blocking client of the store's data plane. One instance per thread.

A DEALER socket sends FetchAdapter and waits for the reply whose (name, version) matches; replies
for other keys (late answers to an earlier fetch) are dropped. After a timeout the socket is
closed and a fresh one made on the next fetch, so nothing late can ever be read as an answer.
The weights come back as a memoryview of the received ZMQ frame (no copy), checked against the
sha256 the store sent with them: bytes that hash differently fail the fetch with DATA_LOSS, so a
worker never caches weights other than those the store registered under that (name, version).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import zmq

from loraserve import errors
from loraserve.internal_auth import Curve
from loraserve.log_limit import RateLimitedLog
from loraserve.sockets import make_socket, send
from loraserve.wire import AdapterPayload, FetchAdapter, FetchFailed, WireError, decode

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[errors.LoraserveError]] = {
    cls.status: cls
    for cls in (
        errors.InvalidAdapterError,
        errors.NotFoundError,
        errors.ResourceExhaustedError,
        errors.UnavailableError,
        errors.DeadlineExceededError,
        errors.PermissionDeniedError,
        errors.AlreadyExistsError,
        errors.DataLossError,
    )
}


@dataclass(frozen=True)
class FetchedAdapter:
    """One adapter version as the store sent it, its weights verified against `sha256`."""

    config_json: bytes
    weights: memoryview
    weights_format: str  # "safetensors" | "bin"
    sha256: str  # hex SHA-256 of `weights`, as the store registered it and as the bytes hash


class AdapterFetcher:
    def __init__(
        self, address: str, timeout_s: float = 10.0, ctx: zmq.Context | None = None, curve: Curve | None = None
    ):
        """`curve`: a worker's CURVE client options for the store's authenticated data port."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address, self.timeout_s, self.curve = address, timeout_s, curve
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._dropped = RateLimitedLog(log)  # a store sending garbage must not flood the worker's log

    def fetch(self, name: str, version: int, trace: dict[str, str] | None = None) -> tuple[bytes, memoryview, str]:
        """(adapter_config.json bytes, weights, weights format) of one adapter version; see `fetch_adapter`."""
        fetched = self.fetch_adapter(name, version, trace)
        return fetched.config_json, fetched.weights, fetched.weights_format

    def fetch_adapter(self, name: str, version: int, trace: dict[str, str] | None = None) -> FetchedAdapter:
        """One adapter version, its weights checked against the sha256 the store sent.

        Raises NotFoundError when the store does not hold it, UnavailableError when it does not
        answer within timeout_s, DataLossError when the weights do not hash to the sha256 sent with
        them (or none was sent), or the error matching another status the store reports.
        """
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER, connect=self.address, curve=self.curve)
        sock = self._sock
        send(sock, FetchAdapter(name=name, version=version, trace=dict(trace or {})))
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                self.close()
                raise errors.UnavailableError(
                    f"the adapter store at {self.address} did not send {name} v{version} within {self.timeout_s:g} s"
                )
            try:
                reply = decode(sock.recv_multipart(copy=False))
            except WireError as e:
                self._dropped.warning(self.address, "malformed reply", "dropped: %s", e)
                continue
            if not isinstance(reply, AdapterPayload | FetchFailed) or (reply.name, reply.version) != (name, version):
                log.debug("dropped a late or unexpected %s reply", type(reply).__name__)
                continue
            if isinstance(reply, FetchFailed):
                raise _ERRORS.get(reply.status, errors.LoraserveError)(reply.error)
            weights = _view(reply.weights)
            if not reply.sha256:
                raise errors.DataLossError(f"the adapter store sent {name} v{version} without its sha256")
            got = hashlib.sha256(weights).hexdigest()
            if got != reply.sha256:
                raise errors.DataLossError(
                    f"{name} v{version}: the weights received hash to {got[:16]}..., not to the store's "
                    f"{reply.sha256[:16]}...; refused"
                )
            return FetchedAdapter(bytes(reply.config_json), weights, reply.weights_format, reply.sha256)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


def _view(buffer: bytes | memoryview) -> memoryview:
    return buffer if isinstance(buffer, memoryview) else memoryview(buffer)
