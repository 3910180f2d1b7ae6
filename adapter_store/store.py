"""Every registered adapter in host RAM, versioned, validated at the door. A plain object: no sockets.

Per (name, version) the store keeps the raw bytes of adapter_config.json and of the weights file
(exactly what workers fetch) and an `AdapterRecord`. Registering a name again makes version + 1;
versions are never reused, even after a delete, so (name, version) always means the same bytes.

Retention: a request keeps the version it started with, and a worker may fetch it after the name
moved on. So a superseded or deleted version is *retired*, not dropped: it stays fetchable for
`retention_s` and counts against the memory budget until it is purged. Purging is lazy (every
call purges what expired) plus whatever periodic `purge_expired` calls the owner makes.

Who owns what: the versions, the high-water marks and the bytes in use are a `VersionTable`
(versions.py, no locks, no clock); the checks are a `Validator` (validation.py); start-up from
storage is `restore.py`. This class adds the locks, the clock, the durable-write order, the rows
(made and released) and the change listeners.

Thread-safe: one lock guards the table; validation (parsing every tensor), packing rows and
hashing run outside it, so the data-plane thread is never held up by a registration.

Start-up: a store made `loading` holds the catalogue only in part until its owner says `loaded`;
meanwhile `check_loaded` refuses the callers from outside (the gRPC service, the data plane)
UNAVAILABLE, so nobody is answered a partial set as if it were all.

Durability (with a `Catalog`, see catalog.py): a registration or a deletion is written to the
data dir or object store before it is acknowledged, and before it changes what RAM serves; a
failed write fails the call (UNAVAILABLE, or RESOURCE_EXHAUSTED for full storage) and changes
nothing. Writes are serialized by a second lock, so the data plane never waits on storage either.
`restore` loads every stored adapter at start, through the same validation as a registration (the
newest good version of each name; nothing good is deleted, see restore.py), and the per-name
high-water marks, so versions stay monotonic across restarts. Host RAM remains the
serving copy. Without a catalog (tests, the offline tools) the store is RAM only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from loraserve.adapter_format import CheckedAdapter
from loraserve.adapter_store import restore
from loraserve.adapter_store.catalog import Catalog
from loraserve.adapter_store.config import MIB, StoreLimits
from loraserve.adapter_store.files import AdapterFiles, read_adapter_dir, resolve_under_root
from loraserve.adapter_store.layout import StoredAdapter
from loraserve.adapter_store.packing import PackedRows, RowsMaker
from loraserve.adapter_store.validation import AdapterRecord, Validator, check_name
from loraserve.adapter_store.versions import Held, StoreStats, VersionTable, rows_bytes
from loraserve.errors import FailedPreconditionError, InvalidRequestError, NotFoundError, UnavailableError
from loraserve.model_config import ModelConfig

log = logging.getLogger(__name__)


class NoAdapterRootError(FailedPreconditionError):
    """RegisterFromPath on a store started without --adapter-root."""


class AdapterStore:
    """Every registered adapter version in host RAM: the serving copy of what the catalog keeps
    durably. Registers (validated, kept durably, then served), deletes, answers reads, tells listeners."""

    def __init__(
        self,
        model: ModelConfig,
        limits: StoreLimits,
        adapter_root: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        catalog: Catalog | None = None,
        rows: RowsMaker | None = None,
        loading: bool = False,
    ):
        self.model, self.limits, self.adapter_root = model, limits, adapter_root
        self.catalog = catalog  # None: RAM only
        self.rows = rows  # None: workers get the files only
        self._clock = clock
        self._lock = threading.Lock()  # guards the table and the listeners
        self._write_lock = threading.Lock()  # held across a durable write: registrations and deletes, in turn
        self._versions = VersionTable(limits)
        self._validator = Validator(model, limits, self.check_fits)
        self._listeners: list[Callable[[], None]] = []  # told (from any thread) that a current version changed
        self._loaded = threading.Event()  # clear while the owner loads the catalogue (`loading`, then `loaded`)
        if not loading:
            self._loaded.set()

    # ---- registering ---------------------------------------------------------------------------
    def register(
        self,
        name: str,
        config_json: bytes,
        weights: bytes,
        weights_format: str = "safetensors",
        source: str = "upload",
    ) -> AdapterRecord:
        """Validate with the engine's own rules, keep durably (with a catalog), then serve as the next version."""
        config_json, weights = bytes(config_json), bytes(weights)  # no copy when given bytes
        record, checked = self._validator.registration(
            name, config_json, weights, weights_format, source, 0, time.time()
        )
        files = AdapterFiles(config_json, weights, weights_format)
        rows = self._pack(checked, record)
        try:
            with self._write_lock:
                with self._lock:
                    self._purge_locked()
                    self._versions.check_fits(len(config_json) + len(weights) + rows_bytes(rows))
                    version = self._versions.next_version(name)  # a failed write burns the number
                    previous = self._versions.current_version_or_none(name)
                record = replace(record, version=version)
                if self.catalog is not None:
                    stored = StoredAdapter(
                        name, version, config_json, weights, weights_format, source, record.created_unix
                    )
                    self.catalog.save(stored, supersedes=previous)
                with self._lock:
                    self._add_locked(record, files, rows)
        except BaseException:
            if rows is not None:  # not served: its shared-memory file goes
                rows.release()
            raise
        log.info(
            "registered adapter %s v%d (rank %d, %s, %.1f MiB) from %s",
            name,
            version,
            record.rank,
            ",".join(record.target_modules),
            record.size_bytes / MIB,
            source,
        )
        return record

    def restore(self) -> int:
        """Serve, for every stored name, its newest version that passes every check (restore.py); returns how many."""
        if self.catalog is None:
            return 0
        return restore.restore(self.catalog, self._validator.stored, self._serve_restored, self._raise_last_versions)

    def loaded(self) -> None:
        """The catalogue (and the preloads) are loaded: what the store holds is what it serves."""
        self._loaded.set()

    def check_loaded(self) -> None:
        """UnavailableError while the catalogue is still being loaded (a store made with `loading`): the
        adapters held so far are only part of it, so no caller may read them, or write, as if complete."""
        if not self._loaded.is_set():
            with self._lock:
                held = len(self._versions.records())
            raise UnavailableError(
                f"the adapter store is still loading its catalogue ({held} adapters so far); retry in a moment"
            )

    def preload(self, name: str, directory: Path) -> AdapterRecord:
        """Register a directory the operator named (anywhere, no root confinement), unless the name's
        current version holds exactly its files.

        So restarting a durable store with the same --preload flags creates no new versions (workers'
        caches stay valid), while a preload whose files changed, or whose name was deleted, registers anew.
        """
        if not directory.is_dir():
            raise NotFoundError(f"adapter directory {directory} does not exist")
        files = read_adapter_dir(directory, self.limits.max_adapter_bytes)
        with self._lock:
            held = self._versions.current(name)
        if held is not None and held.files == files:
            log.info("preload %s: unchanged, keeping v%d", name, held.record.version)
            return held.record
        return self.register(name, files.config_json, files.weights, files.weights_format, source=str(directory))

    def register_from_path(self, name: str, relative_path: str) -> AdapterRecord:
        """Register the PEFT directory `relative_path` below the adapter root (never outside it)."""
        check_name(name)
        if self.adapter_root is None:
            raise NoAdapterRootError("no --adapter-root configured: this store does not register adapters from paths")
        directory = resolve_under_root(self.adapter_root, relative_path)
        try:
            files = read_adapter_dir(directory, self.limits.max_adapter_bytes, confine_to=self.adapter_root)
        except OSError as e:  # unreadable files are the path's problem (INVALID_ARGUMENT), not an internal error
            why = f"{relative_path[:100]!r}: its files cannot be read ({e.strerror})"
            raise InvalidRequestError("path", why) from None
        return self.register(name, files.config_json, files.weights, files.weights_format, source=relative_path)

    def check_fits(self, nbytes: int) -> None:
        """Raise ResourceExhaustedError if `nbytes` more would exceed the memory budget."""
        with self._lock:
            self._purge_locked()
            self._versions.check_fits(nbytes)

    def delete(self, name: str) -> int:
        """Unregister a name; returns the version that was current. It stays fetchable while retained."""
        with self._write_lock:
            with self._lock:
                version = self._versions.current_version(name)
            if self.catalog is not None:
                self.catalog.delete(name, version)  # durable first: a failure leaves the adapter served
            with self._lock:
                _, purged = self._versions.remove(name, self._clock())
                _release(purged)
                self._changed()
        log.info("deleted adapter %s (v%d retained for %g s)", name, version, self.limits.retention_s)
        return version

    # ---- reading -------------------------------------------------------------------------------
    def get_files(self, name: str, version: int) -> AdapterFiles:
        """The files of one version (current or retired); NotFoundError when not held."""
        return self.get_version(name, version)[1]

    def get_version(self, name: str, version: int) -> tuple[AdapterRecord, AdapterFiles]:
        """The record and files of one version (current or retired); NotFoundError when not held."""
        record, files, _ = self.get_rows(name, version)
        return record, files

    def get_rows(self, name: str, version: int) -> tuple[AdapterRecord, AdapterFiles, PackedRows | None]:
        """The record, files and rows (None when this store makes none) of one version; NotFoundError when not held."""
        with self._lock:
            self._purge_locked()
            held = self._versions.get(name, version)
            if held is None:
                raise self._versions.not_held(name, version)
            return held.record, held.files, held.rows

    def describe(self, name: str) -> AdapterRecord:
        with self._lock:
            self._purge_locked()
            return self._versions.current_record(name)

    def list(self) -> list[AdapterRecord]:
        """The current version of every adapter, sorted by name."""
        with self._lock:
            self._purge_locked()
            return self._versions.records()

    def stats(self) -> StoreStats:
        with self._lock:
            self._purge_locked()
            return self._versions.stats()

    def purge_expired(self) -> int:
        """Drop retired versions whose retention ended; returns how many."""
        with self._lock:
            return self._purge_locked()

    # ---- listeners -----------------------------------------------------------------------------
    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` whenever a name's current version changes (registered, replaced, deleted).
        It runs on the changing thread, under the store's lock: it must only signal, e.g. wake a loop.
        Returns the function that unsubscribes it."""
        with self._lock:
            self._listeners.append(listener)
        return lambda: self._unsubscribe(listener)

    def _unsubscribe(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    # ---- internals -----------------------------------------------------------------------------
    def _pack(self, checked: CheckedAdapter, record: AdapterRecord) -> PackedRows | None:
        """The validated weights in the pool's row layout, when this store makes rows (outside the lock)."""
        return self.rows.pack(checked, record.sha256) if self.rows is not None else None

    def _serve_restored(self, record: AdapterRecord, files: AdapterFiles, checked: CheckedAdapter) -> None:
        rows = self._pack(checked, record)
        with self._lock:
            self._add_locked(record, files, rows)

    def _raise_last_versions(self, last: dict[str, int]) -> None:
        with self._lock:
            self._versions.raise_last_versions(last)

    def _add_locked(self, record: AdapterRecord, files: AdapterFiles, rows: PackedRows | None) -> None:
        """Serve `record` as its name's current version; the previous one retires."""
        _release(self._versions.add(Held(record, files, rows=rows), self._clock()))
        self._changed()

    def _purge_locked(self) -> int:
        return len(_release(self._versions.purge(self._clock())))


def _release(gone: list[Held]) -> list[Held]:
    """Remove the shared-memory files of versions that left the table (mappings end when unused)."""
    for held in gone:
        if held.rows is not None:
            held.rows.release()
    return gone
