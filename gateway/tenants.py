"""The auth file (`--auth-file`): tenants, the SHA-256 digests of their API keys, scopes, quotas.

One `[[tenants]]` table per tenant, read with the standard library's TOML parser and checked
strictly: an unknown key, a digest that is not 64 hex digits, a duplicate tenant name or digest, or
an unknown scope is an `InvalidConfigError` naming the tenant and the field. The file holds no
secrets: only digests of keys (`loraserve keys new` makes a key and its line).

    [[tenants]]
    name = "acme"
    api_key_sha256 = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
    scopes = ["generate", "adapters"]
    max_concurrent = 8          # generations in flight (optional)
    tokens_per_minute = 20000   # prompt + output tokens, metered by the scheduler (optional)
"""

from __future__ import annotations

import enum
import tomllib
from dataclasses import dataclass
from pathlib import Path

from loraserve.errors import InvalidConfigError
from loraserve.names import SHA256_HEX, TENANT_NAME

_KEYS = {"name", "api_key_sha256", "scopes", "max_concurrent", "tokens_per_minute"}
MAX_QUOTA = 2**32 - 1  # quotas travel to the scheduler as uint32


class Scope(enum.Enum):
    GENERATE = "generate"  # generate, stream, tokenize, model info, list/describe visible adapters
    ADAPTERS = "adapters"  # also upload / register / delete its own adapters
    ADMIN = "admin"  # everything: public adapters and every tenant's


# What each scope grants: every scope includes the ones below it.
_IMPLIES = {
    Scope.GENERATE: frozenset({Scope.GENERATE}),
    Scope.ADAPTERS: frozenset({Scope.GENERATE, Scope.ADAPTERS}),
    Scope.ADMIN: frozenset(Scope),
}


def granted(scopes: frozenset[Scope]) -> frozenset[Scope]:
    """Every scope `scopes` grant, implied ones included."""
    return frozenset().union(*(_IMPLIES[s] for s in scopes))


@dataclass(frozen=True)
class QuotaLimits:
    max_concurrent: int | None = None  # generations in flight; None: unlimited
    tokens_per_minute: int | None = None  # prompt + max_tokens per request, cluster-wide (scheduler); None: unlimited


@dataclass(frozen=True)
class TenantConfig:
    name: str
    api_key_sha256: tuple[str, ...]  # lowercase hex digests of the tenant's keys
    scopes: frozenset[Scope]  # as granted (implied scopes included)
    limits: QuotaLimits = QuotaLimits()

    def __post_init__(self) -> None:
        if not TENANT_NAME.fullmatch(self.name):
            raise InvalidConfigError(
                f"tenant {self.name[:80]!r}: name must be 1-64 letters, digits, '_' or '-', "
                "starting with a letter or digit"
            )
        for value in (self.limits.max_concurrent, self.limits.tokens_per_minute):
            if value is not None and value < 1:
                raise InvalidConfigError(f"tenant {self.name!r}: quotas must be positive integers")


@dataclass(frozen=True)
class AuthConfig:
    tenants: tuple[TenantConfig, ...]

    def __post_init__(self) -> None:
        names: set[str] = set()
        digests: dict[str, str] = {}
        for tenant in self.tenants:
            if tenant.name in names:
                raise InvalidConfigError(f"tenant {tenant.name!r}: name: defined twice")
            names.add(tenant.name)
            for digest in tenant.api_key_sha256:
                if digest in digests:
                    raise InvalidConfigError(
                        f"tenant {tenant.name!r}: api_key_sha256: digest {digest[:12]}... "
                        f"is also a key of tenant {digests[digest]!r}"
                    )
                digests[digest] = tenant.name


def load_auth_file(path: Path) -> AuthConfig:
    """The auth file at `path`, checked; InvalidConfigError naming the file, tenant and field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidConfigError(f"auth file {path}: cannot read it ({e})") from None
    try:
        return parse_auth_config(text)
    except InvalidConfigError as e:
        raise InvalidConfigError(f"auth file {path}: {e}") from None


def parse_auth_config(text: str) -> AuthConfig:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidConfigError(f"not valid TOML: {e}") from None
    unknown = set(document) - {"tenants"}
    if unknown:
        raise InvalidConfigError(f"unknown top-level key(s) {sorted(unknown)}; expected [[tenants]] tables")
    tables = document.get("tenants", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise InvalidConfigError("tenants: expected [[tenants]] tables")
    return AuthConfig(tuple(_tenant(i, table) for i, table in enumerate(tables)))


def _tenant(index: int, table: dict) -> TenantConfig:
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidConfigError(f"tenant #{index + 1}: name: required, a string")
    where = f"tenant {name[:80]!r}"
    unknown = set(table) - _KEYS
    if unknown:
        raise InvalidConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected {sorted(_KEYS)}")
    digests = table.get("api_key_sha256")
    if not isinstance(digests, list) or not digests or not all(isinstance(d, str) for d in digests):
        raise InvalidConfigError(f"{where}: api_key_sha256: required, a non-empty list of hex SHA-256 digests")
    for digest in digests:
        if not SHA256_HEX.fullmatch(digest.lower()):
            raise InvalidConfigError(f"{where}: api_key_sha256: {digest[:80]!r} is not 64 hex digits")
    if len({d.lower() for d in digests}) != len(digests):
        raise InvalidConfigError(f"{where}: api_key_sha256: a digest is listed twice")
    scopes = table.get("scopes")
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) for s in scopes):
        raise InvalidConfigError(f"{where}: scopes: required, a non-empty list of {[s.value for s in Scope]}")
    known = {s.value: s for s in Scope}
    bad = [s for s in scopes if s not in known]
    if bad:
        raise InvalidConfigError(f"{where}: scopes: unknown {bad}; choose among {sorted(known)}")
    limits = QuotaLimits(_positive(table, "max_concurrent", where), _positive(table, "tokens_per_minute", where))
    return TenantConfig(name, tuple(d.lower() for d in digests), granted(frozenset(known[s] for s in scopes)), limits)


def _positive(table: dict, key: str, where: str) -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUOTA:
        raise InvalidConfigError(f"{where}: {key}: must be a positive integer up to {MAX_QUOTA}, got {value!r}")
    return value
