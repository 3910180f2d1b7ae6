"""Reading a PEFT adapter directory from disk, confined to the store's adapter root when asked.

`resolve_under_root` is the only gate between a client-supplied path and the filesystem: it
refuses absolute paths, '..' and names the filesystem cannot hold (a component over NAME_MAX
bytes, a path over PATH_MAX) outright, then resolves symlinks and refuses anything that lands
outside the root. Any other OSError on the way (a symlink loop, a component that is a file) is
the path's fault too: INVALID_ARGUMENT naming it, never INTERNAL. Files inside the directory are
resolved and checked again (a symlinked adapter_model.safetensors pointing at /etc/shadow is
refused too), and their sizes are checked before a byte is read.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from loraserve.adapter_config import CONFIG_FILE
from loraserve.adapter_format import BIN_FILE, SAFETENSORS_FILE, WEIGHTS_FILES
from loraserve.adapter_store.config import MAX_CONFIG_BYTES, MIB
from loraserve.errors import InvalidRequestError, NotFoundError, PermissionDeniedError, TooLargeError

NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4096  # bytes in a whole path


@dataclass(frozen=True)
class AdapterFiles:
    """The raw bytes of an adapter's two files."""

    config_json: bytes
    weights: bytes
    weights_format: str  # "safetensors" | "bin"


def resolve_under_root(root: Path, relative: str) -> Path:
    """The directory `relative` names below `root`, symlinks resolved; refuses every way out."""
    if not relative:
        raise InvalidRequestError("path", "required: a directory relative to the adapter root")
    if "\x00" in relative:
        raise InvalidRequestError("path", "must not contain NUL characters")
    if PurePosixPath(relative).is_absolute() or PureWindowsPath(relative).is_absolute() or relative.startswith("\\"):
        raise InvalidRequestError("path", f"{relative!r} is absolute; give a path relative to the adapter root")
    parts = PurePosixPath(relative.replace("\\", "/")).parts
    if ".." in parts:
        raise InvalidRequestError("path", f"{relative!r} contains '..'; paths may not leave the adapter root")
    check_path_lengths(parts)
    base = root.resolve(strict=True)
    try:
        return _existing_dir_below(base, relative)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop, on Python < 3.13
        raise InvalidRequestError("path", f"{relative[:100]!r} cannot be read: {_reason(e)}") from None


def check_path_lengths(parts: tuple[str, ...]) -> None:
    """Refuse names the filesystem would refuse with ENAMETOOLONG (an OSError, not the caller's fault to the OS)."""
    long = next((p for p in parts if len(os.fsencode(p)) > NAME_MAX), None)
    if long is not None:
        raise InvalidRequestError("path", f"component {long[:40]!r}... is longer than {NAME_MAX} bytes")
    if sum(len(os.fsencode(p)) + 1 for p in parts) > PATH_MAX:
        raise InvalidRequestError("path", f"is longer than {PATH_MAX} bytes")


def _existing_dir_below(base: Path, relative: str) -> Path:
    target = (base / relative).resolve(strict=False)
    if not target.is_relative_to(base):
        raise PermissionDeniedError(f"path {relative!r} resolves outside the adapter root (through a symlink)")
    if not target.exists():
        raise NotFoundError(f"path {relative!r}: no such directory under the adapter root")
    if not target.is_dir():
        raise InvalidRequestError("path", f"{relative!r} is not a directory")
    return target


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return e.strerror or errno.errorcode.get(e.errno, str(e.errno))
    return str(e) or type(e).__name__


def read_adapter_dir(directory: Path, max_weights_bytes: int, confine_to: Path | None = None) -> AdapterFiles:
    """Read adapter_config.json and the weights file (safetensors preferred, else .bin).

    With `confine_to`, each file must resolve (symlinks followed) to a regular file below it.
    """
    config_path = _checked_file(directory, CONFIG_FILE, confine_to)
    if config_path is None:
        raise InvalidRequestError("path", f"{directory.name}/ has no {CONFIG_FILE}")
    present = [
        (path, fmt) for name, fmt in WEIGHTS_FILES.items() if (path := _checked_file(directory, name, confine_to))
    ]
    if not present:
        raise InvalidRequestError("path", f"{directory.name}/ has no {SAFETENSORS_FILE} (or {BIN_FILE})")
    weights_path, fmt = present[0]  # safetensors first
    config_size = config_path.stat().st_size
    if config_size > MAX_CONFIG_BYTES:
        raise InvalidRequestError(
            CONFIG_FILE, f"is {config_size} bytes; an adapter config may be at most {MAX_CONFIG_BYTES} bytes"
        )
    weights_size = weights_path.stat().st_size
    if weights_size > max_weights_bytes:
        raise TooLargeError(too_large_message(weights_size, max_weights_bytes))
    return AdapterFiles(config_path.read_bytes(), weights_path.read_bytes(), fmt)


def too_large_message(size: int, limit: int) -> str:
    """Why weights of `size` bytes are refused (`TooLargeError`: INVALID_ARGUMENT, HTTP 413, not retried)."""
    return (
        f"adapter weights of {size / MIB:.1f} MiB ({size} bytes) exceed the store's maximum adapter size of "
        f"{limit / MIB:.1f} MiB ({limit} bytes): the store's --max-adapter-mb"
    )


def _checked_file(directory: Path, name: str, confine_to: Path | None) -> Path | None:
    """The resolved path of directory/name, None when absent; refuses escapes and non-regular files."""
    path = directory / name
    if not path.exists() and not path.is_symlink():
        return None
    resolved = path.resolve(strict=False)
    if confine_to is not None and not resolved.is_relative_to(confine_to.resolve()):
        raise PermissionDeniedError(f"{directory.name}/{name} is a symlink that leads outside the adapter root")
    if not resolved.is_file():
        raise InvalidRequestError("path", f"{directory.name}/{name} is not a regular file")
    return resolved
