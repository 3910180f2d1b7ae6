"""The adapter store's durable catalog: every registered version, laid out in a `Backend` (layout.py).

Order makes every change atomic: a registration writes last_version.json, then the two files,
then meta.json — the commit point — and only then removes the version it superseded (its files
first, its meta.json last); a deletion removes meta.json first. Each object is written atomically by
the backend. So after a crash at any point, a version is committed exactly when its meta.json
exists, and last_version.json already covers every version a client was ever told about (delete `a`
at v3, restart, upload `a`: v4).

At start, `load` only lists what is there; it changes nothing. The store (`restore.py`) then walks
each name's committed versions newest first, reading each with `read` (sizes and sha256 re-checked
against meta.json) and validating it as a fresh registration, and serves the first good one.
Nothing good is ever deleted: a version that fails goes to quarantine/ (with a reason.txt and a
WARNING) and the next older one is tried; files without a meta.json (an interrupted registration
or deletion) are quarantined too; an older version is removed only once a newer one has passed.
These moves are made only after every adapter was loaded, so a store that refuses to start moves
nothing.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from loraserve.adapter_config import CONFIG_FILE
from loraserve.adapter_store.layout import (
    META,
    SCHEMA,
    STORE_RECORD,
    WEIGHTS_FILE,
    CorruptEntry,
    StoredAdapter,
    check_file,
    checked_meta,
    counter_name,
    dump,
    last_version_key,
    last_version_record,
    meta_record,
    version_file,
    version_prefix,
)
from loraserve.adapter_store.persistence import QUARANTINE, Backend, StorageConfigError
from loraserve.errors import LoraserveError
from loraserve.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """What the storage holds, as listed at start (nothing read, nothing changed yet)."""

    committed: dict[str, list[int]]  # name -> the versions that have a meta.json, newest first
    uncommitted: list[tuple[str, int]]  # (name, version) with files but no meta.json
    last_versions: dict[str, int]  # name -> highest version ever given out (deleted names included)


def model_identity(model: ModelConfig) -> dict[str, Any]:
    """What adapters are validated against: stored in store.json, compared at every start."""
    fields = ("model_type", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    return {name: getattr(model, name) for name in fields}


class Catalog:
    """Reads and writes the layout through a `Backend`, in the order that keeps every change atomic."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.location = backend.location

    # ---- start-up ----------------------------------------------------------------------------------
    def check_model(self, model: dict[str, Any]) -> None:
        """Bind the storage to one base model: adapters of another model would all fail validation."""
        try:
            raw = self.backend.get(STORE_RECORD)
        except KeyError:
            self.backend.put(STORE_RECORD, dump({"schema": SCHEMA, "model": model}))
            return
        try:
            record = json.loads(raw)
            schema, stored = record["schema"], record["model"]
        except (ValueError, TypeError, KeyError):
            raise StorageConfigError(f"{self.location}/{STORE_RECORD} is not a loraserve store record") from None
        if schema != SCHEMA:
            raise StorageConfigError(f"{self.location} has layout version {schema}; this store reads {SCHEMA}")
        if stored != model:
            raise StorageConfigError(
                f"{self.location} holds adapters of another base model (stored {stored}, this store's model "
                f"{model}); give this model its own data dir or object-store prefix"
            )

    def load(self) -> Found:
        """List every stored version and the high-water marks; reads no adapter and changes nothing."""
        counters: dict[str, int] = {}
        files: dict[tuple[str, int], set[str]] = defaultdict(set)
        for key in self.backend.list_keys():
            parts = key.split("/")
            if key == STORE_RECORD:
                continue
            if (name := counter_name(parts)) is not None:
                counters[name] = self._read_counter(name)
            elif (found := version_file(parts)) is not None:
                files[found[:2]].add(found[2])
            else:
                log.warning("%s: ignoring %s (not part of the store's layout)", self.location, key)
        last = dict(counters)
        committed: dict[str, list[int]] = {}
        uncommitted = []
        for (name, version), present in sorted(files.items()):
            last[name] = max(last.get(name, 0), version)
            if META in present:
                committed.setdefault(name, []).insert(0, version)  # sorted ascending: newest ends up first
            else:
                uncommitted.append((name, version))
        return Found(committed, uncommitted, last)

    def read(self, name: str, version: int) -> StoredAdapter:
        """One committed version, each file's size and sha256 checked against its meta.json.

        Raises CorruptEntry (saying what is wrong) when anything is missing, unreadable or does not match.
        """
        prefix = version_prefix(name, version)
        try:
            meta = checked_meta(self._get(prefix, META), name, version)
            weights_format = meta["weights_format"]
            wanted = (CONFIG_FILE, WEIGHTS_FILE[weights_format])
            contents = [check_file(file, self._get(prefix, file), meta["files"][file]) for file in wanted]
        except OSError as e:
            raise CorruptEntry(f"unreadable: {e}") from None
        return StoredAdapter(
            name, version, contents[0], contents[1], weights_format, meta["source"], float(meta["created_unix"])
        )

    # ---- changes -----------------------------------------------------------------------------------
    def save(self, adapter: StoredAdapter, supersedes: int | None = None) -> None:
        """Keep a new version durably (raises UNAVAILABLE / RESOURCE_EXHAUSTED); then drop `supersedes`."""
        name, version = adapter.name, adapter.version
        prefix = version_prefix(name, version)
        self.backend.put(last_version_key(name), dump({"name": name, "last_version": version}))
        self.backend.put(f"{prefix}/{CONFIG_FILE}", adapter.config_json)
        self.backend.put(f"{prefix}/{WEIGHTS_FILE[adapter.weights_format]}", adapter.weights)
        self.backend.put(f"{prefix}/{META}", dump(meta_record(adapter)))  # the commit point
        if supersedes is not None:
            self._remove_quietly(name, supersedes)

    def delete(self, name: str, version: int) -> None:
        """Unregister durably: meta.json goes first (raises if it cannot), the files after (best effort)."""
        self.backend.delete(f"{version_prefix(name, version)}/{META}")
        self._remove_quietly(name, version)

    def quarantine(self, name: str, version: int, reason: str) -> None:
        """Move a version's objects under quarantine/ with a reason.txt, at WARNING; never fatal (logged)."""
        prefix = version_prefix(name, version)
        stamp = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
        log.warning(
            "%s: %s v%d is not served: %s. Its files were moved, not deleted, to %s/%s/%s/%s/ (with reason.txt): "
            "inspect them, then delete them or register the adapter again",
            self.location,
            name,
            version,
            reason,
            self.location,
            QUARANTINE,
            stamp,
            prefix,
        )
        try:
            keys = self.backend.list_keys(under=prefix)
            self.backend.put(f"{QUARANTINE}/{stamp}/{prefix}/reason.txt", f"{reason}\n".encode())
            for key in keys:
                self.backend.quarantine(key, f"{stamp}/{key}")
        except LoraserveError as e:
            log.warning(
                "%s: could not move %s v%d to %s/ (%s); it is not served and stays where it is",
                self.location,
                name,
                version,
                QUARANTINE,
                e,
            )

    def remove_superseded(self, name: str, version: int, by: int) -> None:
        """Remove a version left behind by a crash, once its newer version `by` has passed every check."""
        log.warning(
            "%s: removing %s v%d: superseded by v%d, which passed verification (a crash came between v%d's "
            "commit and v%d's removal)",
            self.location,
            name,
            version,
            by,
            by,
            version,
        )
        self._remove_quietly(name, version)

    # ---- internals ---------------------------------------------------------------------------------
    def _read_counter(self, name: str) -> int:
        key = last_version_key(name)
        try:
            return last_version_record(self.backend.get(key), name)
        except (ValueError, TypeError, KeyError, OSError) as e:
            log.error("%s: %s is unreadable (%s); using the highest version found instead", self.location, key, e)
            return 0

    def _get(self, prefix: str, file: str) -> bytes:
        """One file of a version; CorruptEntry when it is missing."""
        try:
            return self.backend.get(f"{prefix}/{file}")
        except KeyError:
            raise CorruptEntry(f"{file} is missing") from None

    def _remove_quietly(self, name: str, version: int) -> None:
        """Remove what is left of a version no longer current; a failure only leaves debris for the next start."""
        prefix = version_prefix(name, version)
        try:
            present = {k.rsplit("/", 1)[1] for k in self.backend.list_keys(under=prefix)}
            for file in sorted(present, key=lambda f: f == META):  # meta.json last: a torn removal stays committed
                self.backend.delete(f"{prefix}/{file}")
        except LoraserveError as e:
            log.warning(
                "%s: could not remove %s v%d yet (%s); the next start removes what is left of it (or quarantines it "
                "when its meta.json is gone)",
                self.location,
                name,
                version,
                e,
            )
