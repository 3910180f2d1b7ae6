"""Start-up: serve, for every name in the catalog, its newest stored version that passes every check.

Versions are tried newest first: one that fails verification (catalog.py) or validation
(validation.py) is quarantined and the next older one tried; one over today's --max-adapter-mb /
--max-lora-rank is skipped (not served, left in place: raising the limit serves it again). Files
without a meta.json are quarantined; an older version is removed only once a newer one has passed.
Those moves are made only after everything was loaded: a ResourceExhaustedError (the stored
adapters do not fit the memory budget) leaves the storage exactly as it was. The high-water marks
of all names (deleted, quarantined and skipped ones included) are restored, so no version is reused.

The store hands in how to validate a stored version, how to serve one, and how to raise its
high-water marks (`AdapterStore.restore`); this module decides and moves, and holds nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.adapter_format import CheckedAdapter
from loraserve.adapter_store.catalog import Catalog
from loraserve.adapter_store.files import AdapterFiles
from loraserve.adapter_store.layout import ADAPTERS, CorruptEntry, StoredAdapter
from loraserve.adapter_store.validation import AdapterRecord, OverLimitError
from loraserve.errors import InvalidAdapterError, InvalidRequestError, ResourceExhaustedError

log = logging.getLogger(__name__)

_UNCOMMITTED = (
    "its files have no meta.json, so they were never committed (a registration or a deletion was interrupted)"
)

Validate = Callable[[StoredAdapter], tuple[AdapterRecord, CheckedAdapter]]
Serve = Callable[[AdapterRecord, AdapterFiles, CheckedAdapter], None]


@dataclass
class _RestorePlan:
    """What `restore` decided; the moves are made only once every adapter is loaded."""

    served: int = 0
    quarantine: list[tuple[str, int, str]] = field(default_factory=list)  # (name, version, why)
    superseded: list[tuple[str, int, int]] = field(default_factory=list)  # (name, version, superseded by)
    skipped: list[str] = field(default_factory=list)  # "name vN", over today's limits
    fallbacks: list[tuple[str, int, list[int]]] = field(default_factory=list)  # (name, served, newer ones that failed)


def restore(
    catalog: Catalog, validate: Validate, serve: Serve, raise_last_versions: Callable[[dict[str, int]], None]
) -> int:
    """Serve the newest good version of every stored name, then move what failed; returns how many were served."""
    found = catalog.load()
    plan = _RestorePlan()
    plan.quarantine += [(name, version, _UNCOMMITTED) for name, version in found.uncommitted]
    for name, versions in found.committed.items():
        _restore_name(catalog, name, versions, plan, validate, serve)
    raise_last_versions(found.last_versions)
    for name, version, reason in plan.quarantine:  # the store will start: now move what failed
        catalog.quarantine(name, version, reason)
    for name, version, by in plan.superseded:
        catalog.remove_superseded(name, version, by)
    for name, version, newer in plan.fallbacks:
        log.warning(
            "%s: serving %s v%d, its newest version that passes every check (newer: %s, quarantined above)",
            catalog.location,
            name,
            version,
            ", ".join(f"v{v}" for v in newer),
        )
    log.log(
        logging.WARNING if plan.quarantine or plan.skipped else logging.INFO,
        "restored %d adapter(s) from %s; %d version(s) quarantined, %d adapter(s) skipped as over today's limits%s",
        plan.served,
        catalog.location,
        len(plan.quarantine),
        len(plan.skipped),
        f" ({', '.join(plan.skipped)})" if plan.skipped else "",
    )
    return plan.served


def _restore_name(
    catalog: Catalog, name: str, versions: list[int], plan: _RestorePlan, validate: Validate, serve: Serve
) -> None:
    """Serve the newest good version of `name` (`versions` newest first), noting in `plan` what to move."""
    for i, version in enumerate(versions):
        try:
            stored = catalog.read(name, version)
            record, checked = validate(stored)
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
        serve(record, AdapterFiles(stored.config_json, stored.weights, stored.weights_format), checked)
        plan.served += 1
        if i:
            plan.fallbacks.append((name, version, versions[:i]))
        plan.superseded += [(name, older, version) for older in versions[i + 1 :]]
        return
