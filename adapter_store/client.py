"""`AdapterFetcher`: a worker's blocking client of the store's data plane. One instance per thread.

A DEALER socket sends FetchAdapter and waits for the reply whose (name, version) matches; replies
for other keys (late answers to an earlier fetch) are dropped. After a timeout the socket is
closed and a fresh one made on the next fetch, so nothing late can ever be read as an answer.
The weights come back as a memoryview of the received ZMQ frame (no copy).
"""

from __future__ import annotations

import logging
import time

import zmq

from loraserve import errors
from loraserve.log_limit import RateLimitedLog
from loraserve.sockets import make_socket, send
from loraserve.wire import AdapterFiles, FetchAdapter, FetchFailed, WireError, decode

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
    )
}


class AdapterFetcher:
    def __init__(self, address: str, timeout_s: float = 10.0, ctx: zmq.Context | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address, self.timeout_s = address, timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._dropped = RateLimitedLog(log)  # a store sending garbage must not flood the worker's log

    def fetch(self, name: str, version: int, trace: dict[str, str] | None = None) -> tuple[bytes, memoryview, str]:
        """(adapter_config.json bytes, weights, weights format) of one adapter version.

        Raises NotFoundError when the store does not hold it, UnavailableError when it does not
        answer within timeout_s, or the error matching another status the store reports.
        """
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER, connect=self.address)
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
            if not isinstance(reply, AdapterFiles | FetchFailed) or (reply.name, reply.version) != (name, version):
                log.debug("dropped a late or unexpected %s reply", type(reply).__name__)
                continue
            if isinstance(reply, FetchFailed):
                raise _ERRORS.get(reply.status, errors.LoraserveError)(reply.error)
            return bytes(reply.config_json), _view(reply.weights), reply.weights_format

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


def _view(buffer: bytes | memoryview) -> memoryview:
    return buffer if isinstance(buffer, memoryview) else memoryview(buffer)
