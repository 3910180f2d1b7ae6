"""`AdapterFetcher`: a worker's blocking client of the store's data plane. One instance per thread.

A DEALER socket sends FetchAdapter and waits for the reply whose (name, version) matches; replies
for other keys (late answers to an earlier fetch) are dropped. After a timeout the socket is
closed and a fresh one made on the next fetch, so nothing late can ever be read as an answer.
The weights come back as a memoryview of the received ZMQ frame (no copy), checked against the
sha256 the store sent with them: bytes that hash differently fail the fetch with DATA_LOSS, so a
worker never caches weights other than those the store registered under that (name, version).

`fetch_rows` asks for the adapter already packed in the pool's row layout (`loraserve/pool_rows.py`) and
takes whichever the store sends: rows, whose every layer is checked against the sha256 the store sent for
it (DATA_LOSS otherwise), or the files from a store that packs no rows. With `shared_memory` (the directory
of this user's shared-memory rows, `loraserve/shared_memory.py`) it offers to map the store's file instead of
receiving the bytes; a file that cannot be taken (another host, user or store) is not an error: the rows
are fetched again over the socket, and shared memory is not offered to that store again.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from loraserve import errors
from loraserve.internal_auth import Curve
from loraserve.log_limit import RateLimitedLog
from loraserve.partition import ONE_RANK, Shard
from loraserve.pool_rows import ROW_DTYPES, RowsSpec, layer_digests
from loraserve.shared_memory import SharedMemoryUnavailable, open_rows
from loraserve.sockets import make_socket, send
from loraserve.wire import AdapterPayload, AdapterRows, FetchAdapter, FetchFailed, WireError, decode

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


@dataclass(frozen=True)
class FetchedRows:
    """One adapter version as the store packed it in the pool's row layout; `rows` checked as described above."""

    header: AdapterRows  # everything but the buffers
    config_json: bytes
    rows: memoryview  # [num_layers, num_rows, row_width] of header.dtype: a received frame, or a private mapping
    shared: bool  # mapped from the store's shared memory (no byte crossed the socket)

    @property
    def spec(self) -> RowsSpec:
        h = self.header
        return RowsSpec(h.dtype, h.num_layers, h.num_rows, h.row_width)


class AdapterFetcher:
    def __init__(
        self,
        address: str,
        timeout_s: float = 10.0,
        ctx: zmq.Context | None = None,
        curve: Curve | None = None,
        shared_memory: Path | None = None,
        verify_shared: bool = False,
    ):
        """`curve`: a worker's CURVE client options for the store's authenticated data port. `shared_memory`:
        this user's rows directory, to map rows from a store on this host; `verify_shared`: check a mapped
        file's layer digests too (its bytes crossed no socket, and only this user can write them)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address, self.timeout_s, self.curve = address, timeout_s, curve
        self.shared_memory, self.verify_shared = shared_memory, verify_shared
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
        reply = self._request(FetchAdapter(name=name, version=version, trace=dict(trace or {})))
        if not isinstance(reply, AdapterPayload):
            raise errors.DataLossError(f"the adapter store sent {name} v{version} as rows, not as the files asked for")
        return _checked_files(reply)

    def fetch_rows(
        self,
        name: str,
        version: int,
        row_width: int,
        num_layers: int,
        trace: dict[str, str] | None = None,
        shard: Shard = ONE_RANK,
    ) -> FetchedAdapter | FetchedRows:
        """One adapter version in the row layout of a pool of `row_width` and `num_layers` (see the module
        docstring), or its files when the store has no rows for that shape; `shard`: the part of the rows a
        tensor-parallel rank holds. Raises as `fetch_adapter`."""
        shared = self.shared_memory is not None
        fetch = FetchAdapter(
            name, version, dict(trace or {}), row_width, num_layers, shared, tp_size=shard.size, tp_rank=shard.index
        )
        reply = self._request(fetch)
        if isinstance(reply, AdapterPayload):
            return _checked_files(reply)
        if (reply.tp_size, reply.tp_rank) != (shard.size, shard.index):  # a store that cuts no parts
            return self.fetch_adapter(name, version, trace)
        if reply.shm_name:
            try:
                rows = open_rows(self.shared_memory, reply.shm_name, reply.shm_token, reply.sha256, _spec(reply).nbytes)
            except SharedMemoryUnavailable as e:
                log.warning(
                    "adapter rows from %s: cannot map its shared memory (%s); using the socket", self.address, e
                )
                self.shared_memory = None  # this store's files are not for this worker
                return self.fetch_rows(name, version, row_width, num_layers, trace, shard)
            return _checked_rows(reply, rows, shared=True, verify=self.verify_shared)
        return _checked_rows(reply, _view(reply.rows), shared=False, verify=True)

    def _request(self, fetch: FetchAdapter) -> AdapterPayload | AdapterRows:
        """Send `fetch` and wait for its answer: the files or the rows; raises for FETCH_FAILED or a timeout."""
        name, version = fetch.name, fetch.version
        if self._sock is None:
            self._sock = make_socket(self._ctx, zmq.DEALER, connect=self.address, curve=self.curve)
        sock = self._sock
        send(sock, fetch)
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
            replies = AdapterPayload | AdapterRows | FetchFailed
            if not isinstance(reply, replies) or (reply.name, reply.version) != (name, version):
                log.debug("dropped a late or unexpected %s reply", type(reply).__name__)
                continue
            if isinstance(reply, FetchFailed):
                raise _ERRORS.get(reply.status, errors.LoraserveError)(reply.error)
            return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


def _checked_files(reply: AdapterPayload) -> FetchedAdapter:
    """The files of `reply`, their weights hashed against the sha256 sent with them."""
    weights = _view(reply.weights)
    if not reply.sha256:
        raise errors.DataLossError(f"the adapter store sent {reply.name} v{reply.version} without its sha256")
    got = hashlib.sha256(weights).hexdigest()
    if got != reply.sha256:
        raise errors.DataLossError(
            f"{reply.name} v{reply.version}: the weights received hash to {got[:16]}..., not to the store's "
            f"{reply.sha256[:16]}...; refused"
        )
    return FetchedAdapter(bytes(reply.config_json), weights, reply.weights_format, reply.sha256)


def _spec(reply: AdapterRows) -> RowsSpec:
    if reply.dtype not in ROW_DTYPES:
        raise errors.DataLossError(f"{reply.name} v{reply.version}: rows of unknown dtype {reply.dtype[:16]!r}")
    return RowsSpec(reply.dtype, reply.num_layers, reply.num_rows, reply.row_width)


def _checked_rows(reply: AdapterRows, rows: memoryview, shared: bool, verify: bool) -> FetchedRows:
    """`reply`'s rows, their size and (with `verify`) every layer's sha256 checked against the store's."""
    where = f"{reply.name} v{reply.version}"
    spec = _spec(reply)
    rows = rows.cast("B") if rows.format != "B" or rows.ndim != 1 else rows
    if len(rows) != spec.nbytes:
        raise errors.DataLossError(f"{where}: {len(rows)} bytes of rows received, {spec.nbytes} announced")
    if not reply.sha256:
        raise errors.DataLossError(f"the adapter store sent {where} without its sha256")
    if verify:
        bad = next(
            (i for i, (a, b) in enumerate(zip(layer_digests(rows, spec), reply.digests, strict=True)) if a != b), None
        )
        if bad is not None:
            raise errors.DataLossError(f"{where}: layer {bad} of the rows received does not hash to the store's sha256")
    header = msgspec.structs.replace(reply, config_json=b"", rows=b"")
    return FetchedRows(header, bytes(reply.config_json), rows, shared)


def _view(buffer: bytes | memoryview) -> memoryview:
    return buffer if isinstance(buffer, memoryview) else memoryview(buffer)
