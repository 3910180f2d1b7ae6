"""What a registration must pass, and the record of what passed. Pure: no state, no locks, no I/O.

Checks run in cost order: the name, the format, the sizes (from the limits), a memory-budget check
the caller supplies (a cheap refusal before the expensive part), then every tensor with the
engine's own rules (`loraserve/adapter_format.py`). A stored version at start is checked the same
way, except that today's size and rank limits raise `OverLimitError`: the store skips it in place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from loraserve.adapter_config import CONFIG_FILE
from loraserve.adapter_format import WEIGHTS_FILES, CheckedAdapter, check_adapter_bytes
from loraserve.adapter_store.config import MAX_CONFIG_BYTES, MIB, StoreLimits
from loraserve.adapter_store.files import too_large_message
from loraserve.adapter_store.layout import StoredAdapter
from loraserve.errors import InvalidRequestError, TooLargeError
from loraserve.model_config import ModelConfig
from loraserve.names import STORE_NAME

WEIGHTS_FORMATS = tuple(WEIGHTS_FILES.values())
_ANY_RANK = 2**31  # a stored version is validated with every check but the rank limit, checked after


class OverLimitError(Exception):
    """A stored version over today's --max-adapter-mb or --max-lora-rank: skipped at start, never moved."""


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


@dataclass(frozen=True)
class Validator:
    """The checks of one store: its model and limits, and `fits(nbytes)`, which raises
    ResourceExhaustedError when that many more bytes would exceed the memory budget."""

    model: ModelConfig
    limits: StoreLimits
    fits: Callable[[int], None]

    def registration(
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

        `max_rank` replaces the configured --max-lora-rank (a stored version's rank is checked after)."""
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
            raise TooLargeError(too_large_message(len(weights), self.limits.max_adapter_bytes))
        self.fits(len(config_json) + len(weights))  # cheap refusal before the expensive validation
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

    def stored(self, stored: StoredAdapter) -> tuple[AdapterRecord, CheckedAdapter]:
        """Validate a stored version as a registration, but raise OverLimitError for today's size and rank limits."""
        limit = self.limits.max_adapter_bytes
        if len(stored.weights) > limit:
            raise OverLimitError(
                f"its weights are {len(stored.weights) / MIB:.1f} MiB ({len(stored.weights)} bytes), over this "
                f"store's --max-adapter-mb of {limit / MIB:.1f} MiB ({limit} bytes)"
            )
        record, checked = self.registration(
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
