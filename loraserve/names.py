"""The shapes of names every role checks: adapters, tenants, content hashes. One definition each.

An adapter's name in the store is `[TENANT~]NAME`: a public adapter is `NAME`, a tenant's own is
`TENANT~NAME` (gateway/namespaces.py maps between the two). Tenant names have no '~' or '.', and
public names no '~', so a store name is never ambiguous.
"""

from __future__ import annotations

import re

SEPARATOR = "~"
PUBLIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # an adapter name as clients write it
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
STORE_NAME = re.compile(rf"(?:({TENANT_NAME.pattern}){SEPARATOR})?({PUBLIC_NAME.pattern})")  # groups: tenant, name
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a SHA-256 digest as lowercase hex
