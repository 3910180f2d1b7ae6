"""Where the adapter store keeps its adapters durably: one small key-value interface, two backends.

`Backend` is all the store's durable logic (`catalog.py`) needs: `put` a whole object atomically
and durably, `get`, `delete`, list its keys, and move a key under `quarantine/`. Keys are relative
paths ("adapters/upper/v3/meta.json"); what they mean is the catalog's business, written once.

- `DirectoryBackend` (`--data-dir`): a key is a file below the root. `put` writes a hidden temp
  file beside the target, fsyncs it, renames it over the target and fsyncs the directory, so a
  reader (or a restart after `kill -9` or a power cut) sees the old object or the new one, never a
  torn one. Leftover temp files of a crash mid-write are removed when the backend opens. An
  exclusive lock file (flock) keeps a second store off the same directory. The directory is
  private: created 0700, with directories 0700 and files 0600 inside; opening one that group or
  others can read logs a WARNING (adapters are tenants' data).
- `S3Backend` (`--object-store s3://...`, `s3.py`): a PUT is atomic per object.

Write failures are statuses an operator expects: a full disk is RESOURCE_EXHAUSTED, anything else
UNAVAILABLE (the store is up, its storage is not). A data dir that cannot be created, locked or
written at start-up is a start-up error (`StorageConfigError`), not a failure at the first upload.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import IO, Protocol

from loraserve.errors import InvalidConfigError, LoraserveError, ResourceExhaustedError, UnavailableError

log = logging.getLogger(__name__)

QUARANTINE = "quarantine"  # top-level folder / prefix of moved-away entries; never listed by `list_keys`
LOCK_FILE = ".lock"
_TMP_SUFFIX = ".tmp"  # temp files are ".<name>.<random>.tmp" beside their target
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
DIR_MODE = 0o700  # the data dir and every directory in it
FILE_MODE = 0o600  # every file in it


class StorageConfigError(InvalidConfigError):
    """The data dir or object store cannot be used at all (raised at start-up: the store exits 1)."""


class Backend(Protocol):
    location: str  # for log lines and errors: a directory, or s3://bucket/prefix

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key`, replacing any object there; atomic, and durable on return."""

    def get(self, key: str) -> bytes:
        """The object's bytes; KeyError when there is none, OSError / LoraserveError when unreadable."""

    def delete(self, key: str) -> None:
        """Remove the object (no error if absent); durable on return."""

    def list_keys(self, under: str = "") -> list[str]:
        """Every key (below the folder `under`, if given), sorted; never quarantine/ nor the backend's own files."""

    def quarantine(self, key: str, to: str) -> None:
        """Move `key` to quarantine/`to` (out of `list_keys`, kept for an operator to inspect)."""

    def close(self) -> None: ...


def check_key(key: str) -> list[str]:
    """The key's components; refuses anything that could leave the root or hide as a temp file."""
    parts = key.split("/")
    if not key or any(not p or p in (".", "..") or p.startswith(".") for p in parts):
        raise ValueError(f"invalid storage key {key!r}")
    return parts


def write_error(e: OSError, location: str) -> LoraserveError:
    """The status of a failed write: RESOURCE_EXHAUSTED when the storage is full, else UNAVAILABLE."""
    why = e.strerror or str(e)
    if e.errno in _FULL:
        return ResourceExhaustedError(f"the adapter store's storage {location} is full ({why}); nothing was kept")
    return UnavailableError(f"the adapter store could not write to {location} ({why}); the adapter was not kept")


class DirectoryBackend:
    """Objects as files below `root`, written with temp file + fsync + rename + directory fsync."""

    def __init__(self, root: Path):
        self.root = root
        self.location = str(root)
        self._lock: IO[bytes] | None = None
        try:
            root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)  # missing parents get the usual mode
            self._lock = os.fdopen(os.open(root / LOCK_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE), "ab")
        except OSError as e:
            raise StorageConfigError(f"data dir {root}: cannot create or open it ({e.strerror or e})") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.close()
            raise StorageConfigError(
                f"data dir {root} is in use by another adapter store (its {LOCK_FILE} is locked)"
            ) from None
        self._remove_temp_files()
        self._check_writable()
        _warn_if_open(root)

    # ---- the interface ---------------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            self._make_dirs(path.parent)
            tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(path.parent)
        except OSError as e:
            raise write_error(e, self.location) from e

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
            _fsync_dir(path.parent)
            self._remove_empty_dirs(path.parent)
        except OSError as e:
            raise write_error(e, self.location) from e

    def list_keys(self, under: str = "") -> list[str]:
        found = []
        top = self._path(under) if under else self.root
        for directory, subdirs, files in os.walk(top):
            relative = Path(directory).relative_to(self.root)
            if relative == Path("."):
                subdirs[:] = [d for d in subdirs if d != QUARANTINE]
            subdirs[:] = [d for d in subdirs if not d.startswith(".")]
            found += [(relative / f).as_posix() for f in files if not f.startswith(".")]
        return sorted(found)

    def quarantine(self, key: str, to: str) -> None:
        source, target = self._path(key), self._path(f"{QUARANTINE}/{to}")
        try:
            self._make_dirs(target.parent)
            os.replace(source, target)
            _fsync_dir(target.parent)
            _fsync_dir(source.parent)
            self._remove_empty_dirs(source.parent)
        except OSError as e:
            raise write_error(e, self.location) from e

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    # ---- internals -------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key))

    def _make_dirs(self, directory: Path) -> None:
        """mkdir -p, fsyncing each new directory's parent so the new entry survives a crash."""
        missing = []
        while not directory.exists():
            missing.append(directory)
            directory = directory.parent
        for new in reversed(missing):
            new.mkdir(mode=DIR_MODE, exist_ok=True)
            _fsync_dir(new.parent)

    def _remove_empty_dirs(self, directory: Path) -> None:
        """Drop directories a delete left empty, up to (not including) the root; best effort."""
        while directory != self.root and directory.is_relative_to(self.root):
            try:
                directory.rmdir()
            except OSError:  # not empty (or gone): stop
                return
            directory = directory.parent

    def _remove_temp_files(self) -> None:
        """Temp files are what a crash mid-write leaves behind; they were never committed."""
        removed = 0
        for directory, subdirs, files in os.walk(self.root):
            subdirs[:] = [d for d in subdirs if d != QUARANTINE or Path(directory) != self.root]
            for name in files:
                if name.startswith(".") and name.endswith(_TMP_SUFFIX):
                    Path(directory, name).unlink(missing_ok=True)
                    removed += 1
        if removed:
            log.warning("data dir %s: removed %d temp file(s) left by an interrupted write", self.root, removed)

    def _check_writable(self) -> None:
        probe = f".probe-{secrets.token_hex(4)}"
        try:
            fd = os.open(self.root / probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            os.close(fd)
            os.unlink(self.root / probe)
        except OSError as e:
            self.close()
            raise StorageConfigError(f"data dir {self.root} is not writable ({e.strerror or e})") from None


def _warn_if_open(root: Path) -> None:
    """A WARNING when group or others may read or enter the data dir: every local user could copy the adapters."""
    mode = stat.S_IMODE(root.stat().st_mode)
    if mode & 0o077:
        log.warning(
            "data dir %s has mode %o: other local users can reach the adapters kept in it; run `chmod 700 %s` "
            "(files this store writes are 0600, directories 0700)",
            root,
            mode,
            root,
        )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
