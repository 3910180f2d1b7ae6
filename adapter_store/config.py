"""The adapter store's configuration: limits of the pure store, where it persists, and the service around it.

Both are frozen and validated on construction; `main` builds them from flags (and their
LORASERVE_* twins), nothing else reads flags.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.errors import InvalidConfigError
from loraserve.internal_auth import InternalKeys

MIB = 2**20
GIB = 2**30
MAX_CONFIG_BYTES = 1 * MIB  # adapter_config.json larger than this is refused (it is a few KiB in practice)


@dataclass(frozen=True)
class StoreLimits:
    """What the store accepts and how long it keeps versions nobody can name any more."""

    max_lora_rank: int = 128
    max_adapter_bytes: int = 512 * MIB  # the largest weights file accepted
    budget_bytes: int = 8 * GIB  # host RAM for every held version's files and rows, retained ones included
    retention_s: float = 600.0  # superseded / deleted versions stay fetchable this long

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise InvalidConfigError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_adapter_bytes < 1:
            raise InvalidConfigError(f"max_adapter_bytes must be positive, got {self.max_adapter_bytes}")
        if self.budget_bytes < self.max_adapter_bytes:
            raise InvalidConfigError(
                f"the memory budget ({self.budget_bytes} bytes) is smaller than the largest adapter accepted "
                f"({self.max_adapter_bytes} bytes)"
            )
        if not math.isfinite(self.retention_s) or self.retention_s < 0:
            raise InvalidConfigError(f"retention_s must be a finite number >= 0, got {self.retention_s}")


def default_data_dir() -> Path:
    """`--data-dir`'s default: $XDG_DATA_HOME/loraserve/adapters, or ~/.local/share/loraserve/adapters."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"  # a relative value is ignored
    return base / "loraserve" / "adapters"


def stack_data_dir(base_port: int, model_dir: Path) -> Path:
    """The data dir `loraserve up` gives its store by default: one per stack (base port and model),
    so two local stacks never share one, and restarting the same stack finds its adapters again."""
    model_id = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:8]
    return default_data_dir().parent / "stacks" / f"{base_port}-{model_id}"


@dataclass(frozen=True)
class PersistenceConfig:
    """Where registered adapters are kept across restarts: a data dir, an S3 prefix, or nowhere (RAM only)."""

    data_dir: Path | None = None  # ignored when object_store is set
    object_store: str | None = None  # s3://bucket/prefix
    object_store_endpoint: str | None = None  # e.g. http://127.0.0.1:9000; None: AWS's own

    def __post_init__(self) -> None:
        if self.object_store is not None and not self.object_store.startswith("s3://"):
            raise InvalidConfigError(f"object store {self.object_store!r} must be an s3://BUCKET/PREFIX URL")
        if self.object_store_endpoint is not None and self.object_store is None:
            raise InvalidConfigError("--object-store-endpoint is set but --object-store is not")

    @property
    def durable(self) -> bool:
        return self.data_dir is not None or self.object_store is not None


@dataclass(frozen=True)
class StoreConfig:
    """Everything `loraserve adapter-store` runs with."""

    model_dir: Path  # only its config.json is read
    limits: StoreLimits = field(default_factory=StoreLimits)
    bind: str = "127.0.0.1:7300"  # gRPC control plane
    data_address: str = "tcp://127.0.0.1:7301"  # ZMQ ROUTER workers fetch bytes from
    adapter_root: Path | None = None  # RegisterFromPath reads only below it; None refuses it
    preload: tuple[tuple[str, Path], ...] = ()  # (name, directory) registered before SERVING
    purge_interval_s: float = 10.0  # how often expired versions are dropped when nothing else does it
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)  # RAM only unless set (main sets it)
    keys: InternalKeys | None = None  # data port admits workers only; gRPC needs the internal token
    adapter_rows: bool = True  # keep every version packed in the pool's row layout, for workers that ask
    shm_root: Path | None = Path("/dev/shm")  # where rows go in shared memory for same-host workers; None: sockets only

    def __post_init__(self) -> None:
        if not self.bind:
            raise InvalidConfigError("bind must name an address (host:port)")
        if not self.data_address.startswith(("tcp://", "ipc://", "inproc://")):
            raise InvalidConfigError(f"data_address {self.data_address!r} must be a tcp://, ipc:// or inproc:// URL")
        if self.adapter_root is not None and not self.adapter_root.is_dir():
            raise InvalidConfigError(f"adapter root {self.adapter_root} is not a directory")
        names = [name for name, _ in self.preload]
        if len(set(names)) != len(names):
            raise InvalidConfigError(f"preload names an adapter twice: {sorted(names)}")
        if self.purge_interval_s <= 0:
            raise InvalidConfigError(f"purge_interval_s must be positive, got {self.purge_interval_s}")


def parse_preload(spec: str) -> tuple[str, Path]:
    """'NAME=PATH' -> (name, path); the name is checked when it is registered."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise InvalidConfigError(f"--preload {spec!r}: expected NAME=PATH")
    return name, Path(path)
