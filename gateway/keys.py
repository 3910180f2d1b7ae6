"""`loraserve keys new --tenant NAME`: a fresh API key, and the auth-file lines that admit it.
`loraserve keys internal --out DIR`: the internal keys of a stack whose roles run apart (see
`loraserve/internal_auth.py` for which machine needs which file).

The key is printed once and kept nowhere: the auth file holds only its SHA-256. Give the key to
the tenant; add the lines to the auth file (or only the digest to an existing tenant's
`api_key_sha256` list) and send the gateway SIGHUP.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
from dataclasses import dataclass

from loraserve import internal_auth
from loraserve.config_cli import add_config_arguments, setting
from loraserve.gateway.tenants import TENANT_NAME, Scope

KEY_BYTES = 32  # 256 bits of randomness


@dataclass(frozen=True)
class KeysSettings:
    """`loraserve keys`'s settings."""

    action: str = setting(
        help="new: print a fresh random API key and the lines to add; internal: make a stack's internal keys in --out",
        flag="action",
        choices=("new", "internal"),
    )
    tenant: str | None = setting(None, "new: the tenant the key is for")
    out: str | None = setting(None, "internal: the directory to make (keys already there are kept)")
    scopes: str = setting(
        "generate", f"comma-separated scopes for a new tenant's table, among {', '.join(s.value for s in Scope)}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, KeysSettings)


def new_key() -> tuple[str, str]:
    """(key, its SHA-256 hex digest)."""
    key = secrets.token_urlsafe(KEY_BYTES)
    return key, hashlib.sha256(key.encode()).hexdigest()


def tenant_table(tenant: str, digest: str, scopes: list[str]) -> str:
    """The `[[tenants]]` table admitting one key."""
    quoted = ", ".join(f'"{s}"' for s in scopes)
    return f'[[tenants]]\nname = "{tenant}"\napi_key_sha256 = ["{digest}"]\nscopes = [{quoted}]\n'


def main(args: argparse.Namespace) -> int:
    if args.action == "internal":
        return _internal(args.out)
    if args.tenant is None:
        print("keys new: --tenant NAME is required", file=sys.stderr)
        return 2
    if not TENANT_NAME.fullmatch(args.tenant):
        print(
            f"--tenant {args.tenant!r}: 1-64 letters, digits, '_' or '-', starting with one of the first two",
            file=sys.stderr,
        )
        return 2
    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    known = {s.value for s in Scope}
    if not scopes or any(s not in known for s in scopes):
        print(f"--scopes {args.scopes!r}: choose among {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    key, digest = new_key()
    print(f"API key for tenant {args.tenant} (shown once; the auth file keeps only its SHA-256):")
    print(key)
    print()
    print("Add to the auth file (or add the digest to the tenant's api_key_sha256 list), then SIGHUP the gateway:")
    print()
    print(tenant_table(args.tenant, digest, scopes), end="")
    return 0


def _internal(out: str | None) -> int:
    if out is None:
        print("keys internal: --out DIR is required", file=sys.stderr)
        return 2
    path = internal_auth.generate(out)
    print(f"internal keys in {path}: give every role --internal-keys with a copy holding every *.key, its own")
    print("ROLE.key_secret, and (gateway, scheduler, store) internal-grpc.token; workers never need the token.")
    return 0
