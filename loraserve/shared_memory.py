"""Adapter rows in shared memory: the files the adapter store writes and a worker on the same host maps.

When the store and a worker share a host and a user, the store's reply to a fetch names a file instead of
carrying the rows (`wire.AdapterRows.shm_name`), and the worker maps it: the only copy of the bytes on the
way is the worker's copy into its pool. Layout of the files:

    <root>/loraserve-<uid>/                   mode 0700, owned by that uid (made by the first store)
        p<pid>-<8 hex>/                       one per store process, 0700, removed when it stops
            <32 hex>.rows                     0600: a 4096-byte header, then the rows (`pool_rows.py`)

    header: MAGIC (8 bytes) | token (16 bytes) | sha256 of the weights the rows were packed from (32 bytes)

Lifetime: the store writes a file once, when it registers (or restores) a version, and unlinks it when the
version is purged. It keeps no descriptor and no mapping of it meanwhile (a mapping holds a descriptor:
one per held version would grow without bound as versions are retained): it maps a file only while it
fills it, or while a reply sends its rows over a socket. A worker maps a file once per fetch and holds
that mapping in its host cache, and a mapping stays valid after the unlink (the kernel frees the pages
when the last mapping goes). A store that died leaves its directory behind: the next store on the
host removes the directories of processes that no longer exist.

Who can read or change the bytes: only the uid that runs the store and the worker (and root). A worker
takes a file only if the user's directory, the store's directory and the file are owned by its own uid,
allow nobody else in, and are no symlinks; the file must have exactly the size the reply announces and
carry the reply's random token and weights hash, so a file from another store, host or version never
passes. The mapping is private (copy-on-write): nothing the worker does reaches the store's file.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"LSROWS01"
HEADER_BYTES = 4096  # the rows start page-aligned
DEFAULT_ROOT = Path("/dev/shm")
_INSTANCE = re.compile(r"p(\d{1,10})-[0-9a-f]{8}")
_NAME = re.compile(r"(p\d{1,10}-[0-9a-f]{8})/([0-9a-f]{32}\.rows)")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class SharedMemoryUnavailable(Exception):
    """Shared memory cannot be used here (no such directory, or one that other users could reach)."""


def user_dir(root: Path = DEFAULT_ROOT) -> Path:
    """The directory of this user's rows files under `root`."""
    return Path(root) / f"loraserve-{os.geteuid()}"


def _check_private_dir(path: Path | str | None = None, fd: int | None = None) -> None:
    """Raise SharedMemoryUnavailable unless it is a real directory of this uid that nobody else may enter."""
    info = os.fstat(fd) if fd is not None else os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SharedMemoryUnavailable(f"{path or 'the directory'} is not a directory private to uid {os.geteuid()}")


@dataclass
class SharedRowsFile:
    """One rows file the store wrote: its name (relative to the user's directory), token, path and size."""

    name: str
    token: str  # hex
    path: Path
    nbytes: int  # of the rows (the file holds HEADER_BYTES more)

    @property
    def rows(self) -> memoryview:
        """The rows, mapped now (shared, writable). The mapping, and the one descriptor it holds, end when
        the view is released; FileNotFoundError once the file was unlinked."""
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(fd, HEADER_BYTES + self.nbytes)
        finally:
            os.close(fd)
        return memoryview(mapping)[HEADER_BYTES:]

    def unlink(self) -> None:
        """Remove the file; mappings (this one until it is collected, workers') stay valid."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class SharedRowsDir:
    """The store's own directory of rows files (see the module docstring)."""

    def __init__(self, root: Path = DEFAULT_ROOT):
        base = user_dir(root)
        try:
            base.mkdir(mode=0o700, exist_ok=True)
            _check_private_dir(base)
        except OSError as e:
            raise SharedMemoryUnavailable(f"{base}: {e.strerror or e}") from None
        self.base = base
        self._remove_stale()
        self.instance = f"p{os.getpid()}-{secrets.token_hex(4)}"
        self.path = base / self.instance
        self.path.mkdir(mode=0o700)

    def create(self, nbytes: int, sha256: str) -> SharedRowsFile:
        """A new file of `nbytes` rows (zeros), its header written; the caller fills `rows`. OSError when the
        file system cannot hold it (ENOSPC). No descriptor stays open."""
        name = f"{self.instance}/{secrets.token_hex(16)}.rows"
        path = self.base / name
        token = secrets.token_hex(16)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:  # allocated now: a full tmpfs (a container's 64 MiB /dev/shm) fails here, not with SIGBUS on a write
            os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)
            os.pwrite(fd, MAGIC + bytes.fromhex(token) + bytes.fromhex(sha256), 0)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return SharedRowsFile(name, token, path, nbytes)

    def close(self) -> None:
        """Remove this store's directory and every file in it (workers' mappings stay valid)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def _remove_stale(self) -> None:
        """Remove the directories of stores that died without removing theirs."""
        for entry in os.scandir(self.base):
            match = _INSTANCE.fullmatch(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False) or _alive(int(match[1])):
                continue
            log.info("removing shared-memory rows of a store that is gone: %s", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_rows(base: Path, name: str, token: str, sha256: str, nbytes: int) -> memoryview:
    """The rows of the file `name` under the user's directory `base`, mapped privately (no copy).

    Raises SharedMemoryUnavailable when anything is off (see the module docstring): the caller then asks
    for the rows over the socket instead.
    """
    match = _NAME.fullmatch(name)
    if match is None or not _HEX32.fullmatch(token) or not _HEX64.fullmatch(sha256):
        raise SharedMemoryUnavailable(f"{name[:80]!r}: not a rows file name, token and hash")
    fd = _open_private(base, match[1], match[2])
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise SharedMemoryUnavailable(f"{name}: not a regular file private to uid {os.geteuid()}")
        if info.st_size != HEADER_BYTES + nbytes:
            raise SharedMemoryUnavailable(f"{name}: {info.st_size} bytes, expected {HEADER_BYTES + nbytes}")
        mapping = mmap.mmap(fd, HEADER_BYTES + nbytes, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise SharedMemoryUnavailable(f"{name}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if mapping[: len(MAGIC) + 48] != MAGIC + bytes.fromhex(token) + bytes.fromhex(sha256):
        raise SharedMemoryUnavailable(f"{name}: its header does not match the reply (another store, host or version)")
    return memoryview(mapping)[HEADER_BYTES:]


def _open_private(base: Path, instance: str, file_name: str) -> int:
    """A read-only descriptor of base/instance/file_name, each directory checked private, no symlink followed."""
    fds: list[int] = []
    try:
        fds.append(os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        _check_private_dir(base, fd=fds[-1])
        fds.append(os.open(instance, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
        _check_private_dir(instance, fd=fds[-1])
        return os.open(file_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1])
    except OSError as e:
        raise SharedMemoryUnavailable(f"{base}/{instance}/{file_name}: {e.strerror or e}") from None
    finally:
        for fd in fds:
            os.close(fd)
