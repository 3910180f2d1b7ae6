"""The ZMQ data plane: workers' FETCH_ADAPTER requests answered with the adapter's raw files.

Threading model: one plain-zmq thread owns the ROUTER socket (bound at construction, so a busy
port fails start-up at once, then handed to the thread and touched by nothing else). It is kept
off the asyncio loop so a burst of fetches never delays gRPC handlers and a registration being
validated never delays a fetch; the store's lock is the only thing the two share. Replies are
zero-copy: the store's immutable bytes objects go straight into send_multipart(copy=False), and
ZMQ's I/O thread reads them from there (they stay alive while queued even if purged meanwhile).
Each reply carries the weights' sha256, which the worker's fetcher checks the bytes against.

A worker may ask for the adapter in its pool's row layout (`FetchAdapter.row_width`): a store that packs
rows (`adapter_store/packing.py`) for a model of that shape answers `ADAPTER_ROWS` with the rows as a raw frame
(zero-copy, like the files) and each layer's sha256, or — when the worker said it can map this host's shared
memory and the rows are in a shared-memory file — with that file's name and token and no rows on the
socket. A rank of a tensor-parallel worker asks for its part of the rows (`FetchAdapter.tp_rank` of
`tp_size`), cut for that reply (`RowsMaker.part`). Otherwise it answers with the files, as to any worker.

A malformed message is logged (rate-limited per peer and kind) and dropped; a peer that cannot
take a reply (gone, or its queue full) loses that reply and the worker times out and retries. An
unexpected error that still ends the thread is kept in `failure`, and `watch()` — supervised by
the store's main — raises it, so the store exits non-zero instead of living on without a data plane.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import zmq

from loraserve import telemetry
from loraserve.adapter_store.packing import PackedRows
from loraserve.adapter_store.store import AdapterStore
from loraserve.errors import InvalidConfigError, LoraserveError
from loraserve.internal_auth import InternalKeys
from loraserve.log_limit import RateLimitedLog
from loraserve.partition import Shard
from loraserve.sockets import make_socket, send
from loraserve.supervise import RoleFailed, watch_thread
from loraserve.wire import AdapterPayload, AdapterRows, FetchAdapter, FetchFailed, Message, WireError, decode

log = logging.getLogger(__name__)

POLL_MS = 100  # how often the loop looks at the stop flag


class DataPlane:
    def __init__(self, store: AdapterStore, address: str, keys: InternalKeys | None = None):
        """With `keys`, a CURVE server that serves workers only: any other peer cannot even connect."""
        self.store, self.address = store, address
        self._ctx = zmq.Context()
        self._auth = keys.authenticator(self._ctx) if keys is not None else None
        try:
            self._sock = make_socket(self._ctx, zmq.ROUTER, bind=address, curve=keys.server() if keys else None)
        except zmq.ZMQError:
            self._stop_auth()
            self._ctx.term()
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when bound to ":*"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-data-plane", daemon=True)
        self.served = 0  # replies with files, for logs and tests
        self.failure: BaseException | None = None  # what ended the thread, if anything did
        self._dropped = RateLimitedLog(log)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:  # never started: the socket is still ours to close
            self._close()

    async def watch(self) -> None:
        """Runs while the thread serves; raises when it ended without being asked to stop."""
        await watch_thread(self._thread, lambda: self.failure)
        if not self._stop.is_set():
            raise RoleFailed("the adapter data plane thread ended")
        await asyncio.Event().wait()  # stopping on purpose: wait to be cancelled

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(POLL_MS, zmq.POLLIN):
                    self._serve_one(self._sock.recv_multipart(copy=False))
        except Exception as e:
            log.exception("adapter data plane stopped on an unexpected error")
            self.failure = e
        finally:
            self._close()

    def _close(self) -> None:
        self._sock.close(linger=0)
        self._stop_auth()
        self._ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _serve_one(self, frames: list) -> None:
        peer = frames[0].bytes if frames else b""
        try:
            message = decode(frames[1:])
        except WireError as e:
            self._dropped.warning(peer[:32], "malformed message", "dropped: %s", e)
            return
        if not isinstance(message, FetchAdapter):
            self._dropped.warning(peer[:32], type(message).__name__, "dropped: the store only answers FetchAdapter")
            return
        reply = self._answer(message)
        try:
            send(self._sock, reply, to=peer, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone, ROUTER_MANDATORY) or EAGAIN (its queue is full)
            self._dropped.warning(peer[:32], "reply", "could not send %s v%d: %s", message.name, message.version, e)

    def _answer(self, fetch: FetchAdapter) -> Message:
        trace = {k: v for k, v in fetch.trace.items() if isinstance(k, str) and isinstance(v, str)}
        span_context = telemetry.context_from(trace)
        with telemetry.tracer().start_as_current_span("adapter_store.serve_adapter", context=span_context) as span:
            span.set_attribute("loraserve.adapter.name", fetch.name)
            span.set_attribute("loraserve.adapter.version", fetch.version)
            try:
                self.store.check_loaded()  # UNAVAILABLE, not NOT_FOUND, for what is not loaded yet
                record, files, rows = self.store.get_rows(fetch.name, fetch.version)
            except LoraserveError as e:
                span.set_attribute("loraserve.error", e.status)
                return FetchFailed(fetch.name, fetch.version, status=e.status, error=str(e))
            except Exception as e:  # the loop must survive anything
                log.exception("serving adapter %s v%d failed", fetch.name, fetch.version)
                return FetchFailed(fetch.name, fetch.version, status="INTERNAL", error=f"the store failed: {e}")
            self.served += 1
            if rows is not None:
                try:
                    reply = self._rows_reply(fetch, record.sha256, files.config_json, rows, span)
                except FileNotFoundError:  # purged since `get_rows`: as if it had been before
                    error = f"adapter {fetch.name!r} version {fetch.version} was just released"
                    return FetchFailed(fetch.name, fetch.version, status="NOT_FOUND", error=error)
                except LoraserveError as e:  # a part of the rows this model has not
                    return FetchFailed(fetch.name, fetch.version, status=e.status, error=str(e))
                if reply is not None:
                    return reply
            span.set_attribute("loraserve.adapter.bytes", len(files.config_json) + len(files.weights))
            return AdapterPayload(
                name=fetch.name,
                version=fetch.version,
                weights_format=files.weights_format,
                config_json=files.config_json,
                weights=files.weights,
                sha256=record.sha256,
            )

    def _rows_reply(
        self, fetch: FetchAdapter, sha256: str, config_json: bytes, rows: PackedRows, span
    ) -> AdapterRows | None:
        """The rows `fetch` asks for (a tensor-parallel rank's part cut from them), or None when it asks for
        another shape (then the files go)."""
        if fetch.tp_size > 1:
            if fetch.tp_rank >= fetch.tp_size:
                raise InvalidConfigError(f"tensor-parallel rank {fetch.tp_rank} of {fetch.tp_size} is not a rank")
            rows = self.store.rows.part(rows, Shard(fetch.tp_size, fetch.tp_rank))
        if (fetch.row_width, fetch.num_layers) != (rows.spec.row_width, rows.spec.num_layers):
            return None
        shared = fetch.shared_memory and rows.file is not None
        sent = b"" if shared else rows.buffer  # a file is mapped for this reply only (ZMQ holds the view)
        span.set_attribute("loraserve.adapter.bytes", 0 if shared else rows.spec.nbytes)
        span.set_attribute("loraserve.adapter.shared_memory", shared)
        return AdapterRows(
            name=fetch.name,
            version=fetch.version,
            sha256=sha256,
            rank=rows.rank,
            modules=list(rows.modules),
            layers=list(rows.layers),
            dtype=rows.spec.dtype,
            num_layers=rows.spec.num_layers,
            num_rows=rows.spec.num_rows,
            row_width=rows.spec.row_width,
            digests=rows.digests,
            shm_name=rows.file.name if shared else "",
            shm_token=rows.file.token if shared else "",
            tp_size=fetch.tp_size,
            tp_rank=fetch.tp_rank,
            config_json=config_json,
            rows=sent,
        )
