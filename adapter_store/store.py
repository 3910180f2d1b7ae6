"""Every registered adapter in host RAM, versioned, validated at the door. A plain object: no sockets.

Per (name, version) the store keeps the raw bytes of adapter_config.json and of the weights file
(exactly what workers fetch) and an `AdapterRecord`. Registering a name again makes version + 1;
versions are never reused, even after a delete, so (name, version) always means the same bytes.

Retention: a request keeps the version it started with, and a worker may fetch it after the name
moved on. So a superseded or deleted version is *retired*, not dropped: it stays fetchable for
`retention_s` and counts against the memory budget until it is purged. Purging is lazy (every
call purges what expired) plus whatever periodic `purge_expired` calls the owner makes.

Thread-safe: one lock guards the maps; validation (parsing every tensor) and hashing run outside
it, so the data-plane thread is never held up by a registration.

Durability (with a `Catalog`, see catalog.py): a registration or a deletion is written to the
data dir or object store before it is acknowledged, and before it changes what RAM serves; a
failed write fails the call (UNAVAILABLE, or RESOURCE_EXHAUSTED for full storage) and changes
nothing. Writes are serialized by a second lock, so the data plane never waits on storage either.
`restore` loads every stored adapter at start, through the same validation as a registration (the
newest good version of each name; nothing good is deleted, see `restore`), and the per-name
high-water marks, so versions stay monotonic across restarts. Host RAM remains the
serving copy. Without a catalog (tests, the offline tools) the store is RAM only.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from loraserve.adapter_config import CONFIG_FILE
from loraserve.adapter_format import WEIGHTS_FILES, CheckedAdapter, check_adapter_bytes
from loraserve.adapter_store.catalog import ADAPTERS, Catalog, CorruptEntry, StoredAdapter
from loraserve.adapter_store.config import MAX_CONFIG_BYTES, MIB, StoreLimits
from loraserve.adapter_store.files import (
    AdapterFiles,
    read_adapter_dir,
    resolve_under_root,
    too_large_message,
)
from loraserve.adapter_store.rows import PackedRows, RowsMaker
from loraserve.errors import (
    AdapterNotFoundError,
    FailedPreconditionError,
    InvalidAdapterError,
    InvalidRequestError,
    NotFoundError,
    ResourceExhaustedError,
)
from loraserve.model_config import ModelConfig
from loraserve.names import STORE_NAME

log = logging.getLogger(__name__)

WEIGHTS_FORMATS = tuple(WEIGHTS_FILES.values())
_ANY_RANK = 2**31  # restore validates everything but the rank limit, which it checks itself
_UNCOMMITTED = (
    "its files have no meta.json, so they were never committed (a registration or a deletion was interrupted)"
)


class NoAdapterRootError(FailedPreconditionError):
    """RegisterFromPath on a store started without --adapter-root."""


class OverLimitError(Exception):
    """A stored version over today's --max-adapter-mb or --max-lora-rank: skipped at start, never moved."""


@dataclass
class _RestorePlan:
    """What `restore` decided; the moves are made only once every adapter is loaded."""

    served: int = 0
    quarantine: list[tuple[str, int, str]] = field(default_factory=list)  # (name, version, why)
    superseded: list[tuple[str, int, int]] = field(default_factory=list)  # (name, version, superseded by)
    skipped: list[str] = field(default_factory=list)  # "name vN", over today's limits
    fallbacks: list[tuple[str, int, list[int]]] = field(default_factory=list)  # (name, served, newer ones that failed)


@dataclass(frozen=True)
class AdapterRecord:
    """What the store tells about one version of an adapter."""

    name: str
    version: int
    rank: int
    lora_alpha: float
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    target_modules: tuple[str, ...]
    layers: tuple[int, ...]
    size_bytes: int  # the weights file
    created_unix: float
    source: str  # "upload", or the path it was registered from
    sha256: str  # of the weights file, hex


@dataclass(frozen=True)
class StoreStats:
    adapters: int  # names registered now
    held_versions: int  # versions held, retired ones included
    retired_versions: int
    used_bytes: int  # both files of every held version
    retired_bytes: int
    budget_bytes: int
    max_adapter_bytes: int


@dataclass
class _Held:
    record: AdapterRecord
    files: AdapterFiles
    retired_at: float | None = None  # clock() when superseded or deleted
    rows: PackedRows | None = None  # the weights in the pool's row layout (`rows.py`), with a RowsMaker

    @property
    def nbytes(self) -> int:
        """Host RAM it holds: its files, and its rows (in RAM or in shared memory, which is RAM too)."""
        return len(self.files.config_json) + len(self.files.weights) + _rows_bytes(self.rows)


def _rows_bytes(rows: PackedRows | None) -> int:
    return rows.buffer.nbytes if rows is not None else 0


def check_name(name: str, field: str = "name") -> None:
    """Raise InvalidRequestError unless `name` is a valid adapter name."""
    if not name:
        raise InvalidRequestError(field, "required: the adapter's name")
    if not STORE_NAME.fullmatch(name):
        raise InvalidRequestError(
            field,
            f"{name[:140]!r} is not a valid adapter name: 1-128 characters, letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
        )


class AdapterStore:
    """Every registered adapter version in host RAM: the serving copy of what the catalog keeps
    durably. Owns names, versions (current and retired), the memory budget and change listeners."""

    def __init__(
        self,
        model: ModelConfig,
        limits: StoreLimits,
        adapter_root: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        catalog: Catalog | None = None,
        rows: RowsMaker | None = None,
    ):
        self.model, self.limits, self.adapter_root = model, limits, adapter_root
        self.catalog = catalog  # None: RAM only
        self.rows = rows  # None: workers get the files only
        self._clock = clock
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # held across a durable write: registrations and deletes, in turn
        self._held: dict[tuple[str, int], _Held] = {}
        self._current: dict[str, int] = {}  # name -> current version
        self._listeners: list[Callable[[], None]] = []  # told (from any thread) that a current version changed
        self._last_version: dict[str, int] = {}  # survives deletes: versions are never reused
        self._retired: deque[tuple[float, tuple[str, int]]] = deque()  # (retired at, key), oldest first
        self._used = 0

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
        record, checked = self._validate(name, config_json, weights, weights_format, source, 0, time.time())
        files = AdapterFiles(config_json, weights, weights_format)
        rows = self._pack(checked, record)
        try:
            with self._write_lock:
                with self._lock:
                    self._purge_locked()
                    self._check_fits_locked(len(config_json) + len(weights) + _rows_bytes(rows))
                    version = self._last_version.get(name, 0) + 1
                    self._last_version[name] = version  # a failed write burns the number: versions only go up
                    previous = self._current.get(name)
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

    def _validate(
        self,
        name: str,
        config_json: bytes,
        weights: bytes,
        weights_format: str,
        source: str,
        version: int,
        created: float,
        max_rank: int | None = None,
    ) -> tuple[AdapterRecord, CheckedAdapter]:
        """Every check a registration makes, in cost order; the record of what passed, and its weights.

        `max_rank` replaces the configured --max-lora-rank (restore checks the rank itself)."""
        check_name(name)
        if weights_format not in WEIGHTS_FORMATS:
            raise InvalidRequestError(
                "weights_format", f"{weights_format!r} is not one of {', '.join(WEIGHTS_FORMATS)}"
            )
        if len(config_json) > MAX_CONFIG_BYTES:
            raise InvalidRequestError(
                CONFIG_FILE, f"is {len(config_json)} bytes; an adapter config may be at most {MAX_CONFIG_BYTES} bytes"
            )
        if len(weights) > self.limits.max_adapter_bytes:
            raise ResourceExhaustedError(too_large_message(len(weights), self.limits.max_adapter_bytes))
        self.check_fits(len(config_json) + len(weights))  # cheap refusal before the expensive validation
        max_rank = self.limits.max_lora_rank if max_rank is None else max_rank
        adapter = check_adapter_bytes(config_json, weights, self.model, max_rank, weights_format)
        record = AdapterRecord(
            name=name,
            version=version,
            rank=adapter.config.rank,
            lora_alpha=adapter.config.lora_alpha,
            scale=adapter.config.scale,
            target_modules=adapter.modules,
            layers=adapter.layers,
            size_bytes=len(weights),
            created_unix=created,
            source=source,
            sha256=hashlib.sha256(weights).hexdigest(),
        )
        return record, adapter

    def _pack(self, checked: CheckedAdapter, record: AdapterRecord) -> PackedRows | None:
        """The validated weights in the pool's row layout, when this store makes rows (outside the lock)."""
        return self.rows.pack(checked, record.sha256) if self.rows is not None else None

    def _add_locked(self, record: AdapterRecord, files: AdapterFiles, rows: PackedRows | None = None) -> None:
        """Serve `record` as its name's current version; the previous one retires."""
        name, version = record.name, record.version
        replaced = self._held.get((name, version))
        if replaced is not None:
            self._used -= replaced.nbytes
            if replaced.rows is not None:
                replaced.rows.release()
        held = self._held[(name, version)] = _Held(record, files, rows=rows)
        self._used += held.nbytes
        previous = self._current.get(name)
        if previous is not None:
            self._retire_locked(name, previous)
        self._current[name] = version
        self._last_version[name] = max(version, self._last_version.get(name, 0))
        self._purge_locked()  # a zero retention drops the superseded version at once
        self._changed()

    # ---- start-up: what the catalog holds, and preloads ----------------------------------------
    def restore(self) -> int:
        """Serve, for every stored name, its newest version that passes every check; returns how many.

        Versions are tried newest first: one that fails verification or validation is quarantined and
        the next older one tried; one over today's --max-adapter-mb / --max-lora-rank is skipped (not
        served, left in place: raising the limit serves it again). Files without a meta.json are
        quarantined; an older version is removed only once a newer one has passed. Those moves are
        made only after everything was loaded: raising ResourceExhaustedError (the stored adapters do
        not fit the memory budget) leaves the storage exactly as it was. The high-water marks of all
        names (deleted, quarantined and skipped ones included) are restored, so no version is reused.
        """
        if self.catalog is None:
            return 0
        found = self.catalog.load()
        plan = _RestorePlan()
        plan.quarantine += [(name, version, _UNCOMMITTED) for name, version in found.uncommitted]
        for name, versions in found.committed.items():
            self._restore_name(self.catalog, name, versions, plan)
        with self._lock:
            for name, version in found.last_versions.items():
                self._last_version[name] = max(version, self._last_version.get(name, 0))
        for name, version, reason in plan.quarantine:  # the store will start: now move what failed
            self.catalog.quarantine(name, version, reason)
        for name, version, by in plan.superseded:
            self.catalog.remove_superseded(name, version, by)
        for name, version, newer in plan.fallbacks:
            log.warning(
                "%s: serving %s v%d, its newest version that passes every check (newer: %s, quarantined above)",
                self.catalog.location,
                name,
                version,
                ", ".join(f"v{v}" for v in newer),
            )
        log.log(
            logging.WARNING if plan.quarantine or plan.skipped else logging.INFO,
            "restored %d adapter(s) from %s; %d version(s) quarantined, %d adapter(s) skipped as over today's limits%s",
            plan.served,
            self.catalog.location,
            len(plan.quarantine),
            len(plan.skipped),
            f" ({', '.join(plan.skipped)})" if plan.skipped else "",
        )
        return plan.served

    def _restore_name(self, catalog: Catalog, name: str, versions: list[int], plan: _RestorePlan) -> None:
        """Serve the newest good version of `name` (`versions` newest first), noting in `plan` what to move."""
        for i, version in enumerate(versions):
            try:
                stored = catalog.read(name, version)
                record, checked = self._validate_stored(stored)
            except CorruptEntry as e:
                plan.quarantine.append((name, version, f"it is corrupt ({e})"))
                continue
            except OverLimitError as e:
                log.warning(
                    "%s: not serving %s v%d: %s. Its files stay in place: restart with a higher limit to serve it "
                    "again, or remove %s/%s/%s to drop it",
                    catalog.location,
                    name,
                    version,
                    e,
                    catalog.location,
                    ADAPTERS,
                    name,
                )
                plan.skipped.append(f"{name} v{version}")
                return  # older versions stay too: a raised limit serves this one and removes them then
            except (InvalidRequestError, InvalidAdapterError) as e:
                plan.quarantine.append((name, version, f"it no longer passes validation ({e})"))
                continue
            except ResourceExhaustedError as e:  # the memory budget: a start-up error, nothing is moved away
                raise ResourceExhaustedError(f"restoring {name} v{version} from {catalog.location}: {e}") from None
            rows = self._pack(checked, record)
            with self._lock:
                self._add_locked(record, AdapterFiles(stored.config_json, stored.weights, stored.weights_format), rows)
            plan.served += 1
            if i:
                plan.fallbacks.append((name, version, versions[:i]))
            plan.superseded += [(name, older, version) for older in versions[i + 1 :]]
            return

    def _validate_stored(self, stored: StoredAdapter) -> tuple[AdapterRecord, CheckedAdapter]:
        """Validate a stored version as a registration, but raise OverLimitError for today's size and rank limits."""
        limit = self.limits.max_adapter_bytes
        if len(stored.weights) > limit:
            raise OverLimitError(
                f"its weights are {len(stored.weights) / MIB:.1f} MiB ({len(stored.weights)} bytes), over this "
                f"store's --max-adapter-mb of {limit / MIB:.1f} MiB ({limit} bytes)"
            )
        record, checked = self._validate(
            stored.name,
            stored.config_json,
            stored.weights,
            stored.weights_format,
            stored.source,
            stored.version,
            stored.created_unix,
            max_rank=_ANY_RANK,
        )
        if record.rank > self.limits.max_lora_rank:
            raise OverLimitError(
                f"its rank {record.rank} is over this store's --max-lora-rank of {self.limits.max_lora_rank}"
            )
        return record, checked

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
            version = self._current.get(name)
            held = self._held.get((name, version)) if version is not None else None
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
            self._check_fits_locked(nbytes)

    # ---- reading -------------------------------------------------------------------------------
    def get_files(self, name: str, version: int) -> AdapterFiles:
        """The files of one version (current or retired); NotFoundError when not held."""
        return self.get_version(name, version)[1]

    def get_version(self, name: str, version: int) -> tuple[AdapterRecord, AdapterFiles]:
        """The record and files of one version (current or retired); NotFoundError when not held."""
        with self._lock:
            self._purge_locked()
            held = self._held.get((name, version))
            if held is not None:
                return held.record, held.files
            current = self._current.get(name)
            last = self._last_version.get(name)
        if last is None:
            raise AdapterNotFoundError(name)
        why = f"adapter {name!r} was deleted" if current is None else f"adapter {name!r} is at version {current}"
        if 1 <= version <= last:
            why += f" and version {version} was released (retired versions are kept {self.limits.retention_s:g} s)"
        else:
            why += f"; version {version} never existed"
        raise NotFoundError(why)

    def get_rows(self, name: str, version: int) -> tuple[AdapterRecord, AdapterFiles, PackedRows | None]:
        """`get_version`, and the version's rows (None when this store makes none)."""
        with self._lock:
            self._purge_locked()
            held = self._held.get((name, version))
            if held is not None:
                return held.record, held.files, held.rows
        return (*self.get_version(name, version), None)  # raises the precise NotFoundError

    def describe(self, name: str) -> AdapterRecord:
        with self._lock:
            self._purge_locked()
            version = self._current.get(name)
            if version is None:
                raise AdapterNotFoundError(name, list(self._current))
            return self._held[(name, version)].record

    def list(self) -> list[AdapterRecord]:
        """The current version of every adapter, sorted by name."""
        with self._lock:
            self._purge_locked()
            return [self._held[(name, self._current[name])].record for name in sorted(self._current)]

    def delete(self, name: str) -> int:
        """Unregister a name; returns the version that was current. It stays fetchable while retained."""
        with self._write_lock:
            with self._lock:
                version = self._current.get(name)
                if version is None:
                    raise AdapterNotFoundError(name, list(self._current))
            if self.catalog is not None:
                self.catalog.delete(name, version)  # durable first: a failure leaves the adapter served
            with self._lock:
                del self._current[name]
                self._retire_locked(name, version)
                self._purge_locked()
                self._changed()
        log.info("deleted adapter %s (v%d retained for %g s)", name, version, self.limits.retention_s)
        return version

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

    def stats(self) -> StoreStats:
        with self._lock:
            self._purge_locked()
            retired = [h for h in self._held.values() if h.retired_at is not None]
            return StoreStats(
                adapters=len(self._current),
                held_versions=len(self._held),
                retired_versions=len(retired),
                used_bytes=self._used,
                retired_bytes=sum(h.nbytes for h in retired),
                budget_bytes=self.limits.budget_bytes,
                max_adapter_bytes=self.limits.max_adapter_bytes,
            )

    def purge_expired(self) -> int:
        """Drop retired versions whose retention ended; returns how many."""
        with self._lock:
            return self._purge_locked()

    # ---- internals (self._lock held) -----------------------------------------------------------
    def _retire_locked(self, name: str, version: int) -> None:
        now = self._clock()
        self._held[(name, version)].retired_at = now
        self._retired.append((now, (name, version)))

    def _purge_locked(self) -> int:
        """Drop expired versions: O(expired), as retirements are queued in time order."""
        now, purged = self._clock(), 0
        while self._retired and now - self._retired[0][0] >= self.limits.retention_s:
            _, key = self._retired.popleft()
            held = self._held.pop(key)
            self._used -= held.nbytes
            if held.rows is not None:
                held.rows.release()
            purged += 1
            log.info("purged adapter %s v%d (retention over)", *key)
        return purged

    def _check_fits_locked(self, nbytes: int) -> None:
        budget = self.limits.budget_bytes
        if self._used + nbytes <= budget:
            return
        retired = [h for h in self._held.values() if h.retired_at is not None]
        retired_bytes = sum(h.nbytes for h in retired)
        raise ResourceExhaustedError(
            f"host-RAM budget exhausted: the adapter needs {nbytes / MIB:.1f} MiB but {self._used / MIB:.1f} of "
            f"{budget / MIB:.1f} MiB are in use ({retired_bytes / MIB:.1f} MiB by {len(retired)} superseded or "
            f"deleted version(s) kept up to {self.limits.retention_s:g} s for requests in flight); "
            "delete adapters or raise the store's memory budget"
        )
