"""The durable catalog's layout: its keys and its JSON records, built and checked. Pure: no I/O.

Keys below the data dir or the bucket prefix:

    store.json                                  {"schema": 1, "model": {...}}: the base model's shapes
    adapters/<name>/last_version.json           the name's high-water mark: versions are never reused
    adapters/<name>/v<N>/adapter_config.json    the files as registered
    adapters/<name>/v<N>/adapter_model.safetensors   (or adapter_model.bin)
    adapters/<name>/v<N>/meta.json              name, version, format, source, created, sha256 + size per file
    quarantine/<time>-<id>/...                  entries that failed verification at start, with reason.txt

`catalog.py` reads and writes them through a `Backend`; this module says what each key and record
must be, and raises `CorruptEntry` (saying why) for one that is not.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from loraserve.adapter_config import CONFIG_FILE
from loraserve.adapter_format import WEIGHTS_FILES

SCHEMA = 1
STORE_RECORD = "store.json"
ADAPTERS = "adapters"
LAST_VERSION = "last_version.json"
META = "meta.json"
WEIGHTS_FILE = {fmt: file for file, fmt in WEIGHTS_FILES.items()}  # "safetensors" -> adapter_model.safetensors
_VERSION_DIR = re.compile(r"v([1-9][0-9]{0,9})")


class CorruptEntry(Exception):
    """A stored version that cannot be trusted; the message says why."""


@dataclass(frozen=True)
class StoredAdapter:
    """One registered version, as kept durably."""

    name: str
    version: int
    config_json: bytes
    weights: bytes
    weights_format: str  # "safetensors" | "bin"
    source: str  # "upload", or the path it was registered from
    created_unix: float


def version_prefix(name: str, version: int) -> str:
    return f"{ADAPTERS}/{name}/v{version}"


def last_version_key(name: str) -> str:
    return f"{ADAPTERS}/{name}/{LAST_VERSION}"


def counter_name(parts: list[str]) -> str | None:
    """The adapter name when the key's `parts` are adapters/<name>/last_version.json, else None."""
    return parts[1] if len(parts) == 3 and parts[0] == ADAPTERS and parts[2] == LAST_VERSION else None


def version_file(parts: list[str]) -> tuple[str, int, str] | None:
    """(name, version, file) when the key's `parts` are adapters/<name>/v<N>/<file>, else None."""
    if len(parts) == 4 and parts[0] == ADAPTERS and (match := _VERSION_DIR.fullmatch(parts[2])):
        return parts[1], int(match[1]), parts[3]
    return None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dump(record: dict[str, Any]) -> bytes:
    return json.dumps(record, indent=1, sort_keys=True).encode()


def last_version_record(raw: bytes, name: str) -> int:
    """The high-water mark in a last_version.json; ValueError (or TypeError, KeyError) when it is not one."""
    record = json.loads(raw)
    value = record["last_version"]
    if record["name"] != name or not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(record)
    return value


def meta_record(adapter: StoredAdapter) -> dict[str, Any]:
    """The meta.json of a version: written last, it is the version's commit point."""
    return {
        "schema": SCHEMA,
        "name": adapter.name,
        "version": adapter.version,
        "weights_format": adapter.weights_format,
        "source": adapter.source,
        "created_unix": adapter.created_unix,
        "files": {
            CONFIG_FILE: {"sha256": sha256(adapter.config_json), "size": len(adapter.config_json)},
            WEIGHTS_FILE[adapter.weights_format]: {"sha256": sha256(adapter.weights), "size": len(adapter.weights)},
        },
    }


def checked_meta(raw: bytes, name: str, version: int) -> dict[str, Any]:
    """A version's meta.json, checked for shape (not yet against the files)."""
    try:
        meta = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise CorruptEntry(f"{META} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        raise CorruptEntry(f"{META} is not a schema-{SCHEMA} record")
    if (meta.get("name"), meta.get("version")) != (name, version):
        raise CorruptEntry(f"{META} names {meta.get('name')!r} v{meta.get('version')}, not its own path")
    weights_format = meta.get("weights_format")
    if weights_format not in WEIGHTS_FILE:
        raise CorruptEntry(f"{META}: unknown weights_format {weights_format!r}")
    source, created = meta.get("source"), meta.get("created_unix")
    if not isinstance(source, str) or not isinstance(created, int | float) or isinstance(created, bool):
        raise CorruptEntry(f"{META}: source or created_unix missing")
    expected = meta.get("files")
    wanted = (CONFIG_FILE, WEIGHTS_FILE[weights_format])
    if not isinstance(expected, dict) or set(expected) != set(wanted):
        raise CorruptEntry(f"{META}: 'files' must list exactly {', '.join(wanted)}")
    return meta


def check_file(file: str, data: bytes, expected: Any) -> bytes:
    """`data`, when its size and sha256 are what meta.json says (`expected`); CorruptEntry otherwise."""
    if not isinstance(expected, dict) or len(data) != expected.get("size"):
        raise CorruptEntry(f"{file} is {len(data)} bytes, {META} says {expected}")
    if sha256(data) != expected.get("sha256"):
        raise CorruptEntry(f"{file} does not match its sha256 in {META}")
    return data
