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

from loraserve.config_cli import directory_setting, setting
from loraserve.errors import InvalidConfigError
from loraserve.internal_auth import InternalKeys
from loraserve.model_config import DEFAULT_MAX_LORA_RANK
from loraserve.shared_defaults import ADAPTER_ROWS, SHARED_MEMORY_ROOT, STORE_ADDRESS, STORE_DATA_ADDRESS

MIB = 2**20
GIB = 2**30
MAX_CONFIG_BYTES = 1 * MIB  # adapter_config.json larger than this is refused (it is a few KiB in practice)


@dataclass(frozen=True)
class StoreLimits:
    """What the store accepts and how long it keeps versions nobody can name any more."""

    max_lora_rank: int = setting(DEFAULT_MAX_LORA_RANK, "largest LoRA rank accepted")
    max_adapter_bytes: int = setting(
        512 * MIB,
        "largest weights file accepted, MiB",
        flag="--max-adapter-mb",
        flag_type=float,
        parse=lambda mib: int(mib * MIB),
        show=lambda n: n / MIB,
    )
    budget_bytes: int = setting(
        8 * GIB,
        "host RAM for adapters (their files and pool rows), GiB",
        flag="--memory-budget-gb",
        flag_type=float,
        parse=lambda gib: int(gib * GIB),
        show=lambda n: n / GIB,
    )  # every held version's, retained ones included
    retention_s: float = setting(
        600.0, "seconds a superseded or deleted version stays fetchable for requests in flight"
    )

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

    data_dir: Path | None = setting(
        None,
        "directory every registered adapter is written to before the registration is acknowledged, and "
        "reloaded from at start (re-verified; corrupt entries moved to DIR/quarantine/, never deleted; "
        "created private, mode 0700)",
        metavar="DIR",
        flag_type=str,
        parse=lambda text: Path(text) if text else None,
        show=lambda path: None if path is None else str(path),
    )  # ignored when object_store is set
    object_store: str | None = setting(
        None,
        "keep adapters in S3-compatible object storage instead of --data-dir (credentials: the standard AWS "
        "variables or boto3's other sources; needs boto3: pip install 'loraserve[s3]')",
        metavar="s3://BUCKET/PREFIX",
    )
    object_store_endpoint: str | None = setting(
        None, "the object store's endpoint (default: AWS S3)", metavar="URL"
    )  # e.g. http://127.0.0.1:9000

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
    bind: str = setting(STORE_ADDRESS, "gRPC control-plane address")
    data_address: str = setting(STORE_DATA_ADDRESS, "ZMQ address workers fetch from")  # a ROUTER
    adapter_root: Path | None = setting(
        None, "directory RegisterFromPath may read below (unset: RegisterFromPath is refused)"
    )
    preload: tuple[tuple[str, Path], ...] = setting(
        (),
        "register the PEFT directory PATH as NAME before serving (repeatable; in the env twin, comma-separated)",
        metavar="NAME=PATH",
        flag_type=str,
        parse=lambda specs: tuple(parse_preload(spec) for spec in specs),
        show=lambda pairs: [f"{name}={path}" for name, path in pairs],
    )  # (name, directory) registered before SERVING
    purge_interval_s: float = setting(10.0, "seconds between drops of expired versions when nothing else drops them")
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)  # RAM only unless set (main sets it)
    keys: InternalKeys | None = None  # data port admits workers only; gRPC needs the internal token
    adapter_rows: bool = setting(
        ADAPTER_ROWS,
        "keep each version packed in the workers' pool row layout too (about its size again in RAM), so a "
        "worker copies it into its pool without parsing or packing (--no-adapter-rows: the files only)",
    )
    shm_root: Path | None = directory_setting(
        SHARED_MEMORY_ROOT,
        "a tmpfs where the packed rows live, mapped by workers on this host and user instead of sent over "
        "the socket (a private loraserve-UID directory is made there); empty: sockets only",
        flag="--shared-memory-root",
    )

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
