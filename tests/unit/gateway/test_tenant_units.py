"""Tenancy's pure parts: the auth file's checks, key matching, namespaces, quotas, the bind rule."""

from __future__ import annotations

import hashlib

import pytest

from loraserve.errors import InvalidConfigError, InvalidRequestError, UnauthenticatedError
from loraserve.gateway.auth import Authenticator
from loraserve.gateway.bind_rule import check_bind, is_loopback
from loraserve.gateway.namespaces import Namespace, owner_of
from loraserve.gateway.slots import SlotLimitError, TenantSlots
from loraserve.gateway.tenants import QuotaLimits, Scope, parse_auth_config


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenant(name: str, key: str, scopes: str = '"generate"', extra: str = "") -> str:
    return f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{digest(key)}"]\nscopes = [{scopes}]\n{extra}\n'


def test_a_valid_file_parses_with_implied_scopes_and_quotas():
    config = parse_auth_config(
        tenant("a", "ka", '"adapters"', "max_concurrent = 2\ntokens_per_minute = 600") + tenant("ops", "ko", '"admin"')
    )
    a, ops = config.tenants
    assert a.scopes == {Scope.GENERATE, Scope.ADAPTERS}
    assert ops.scopes == set(Scope)
    assert a.limits == QuotaLimits(2, 600) and ops.limits == QuotaLimits()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (tenant("a", "k", extra="colour = 1"), "tenant 'a': unknown key(s) ['colour']"),
        ('[[tenants]]\nname = "a"\napi_key_sha256 = ["xyz"]\nscopes = ["generate"]\n', "'xyz' is not 64 hex"),
        (tenant("a", "k1") + tenant("a", "k2"), "tenant 'a': name: defined twice"),
        (tenant("a", "k") + tenant("b", "k"), "tenant 'b': api_key_sha256: digest"),
        (tenant("a", "k", '"generate", "root"'), "tenant 'a': scopes: unknown ['root']"),
        (tenant("a~b", "k"), "tenant 'a~b': name must be"),
        (tenant("a", "k", extra="max_concurrent = 0"), "tenant 'a': max_concurrent: must be a positive"),
        (tenant("a", "k", extra="tokens_per_minute = 4294967296"), "tenant 'a': tokens_per_minute: must be a positive"),
        ('[[tenants]]\nname = "a"\nscopes = ["generate"]\n', "tenant 'a': api_key_sha256: required"),
        ("[server]\nport = 1\n", "unknown top-level key(s) ['server']"),
        ("[[tenants]\n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_naming_the_tenant_and_field(text, message):
    with pytest.raises(InvalidConfigError) as info:
        parse_auth_config(text)
    assert message in str(info.value)


def test_keys_map_to_their_tenant_and_anything_else_is_unauthenticated():
    auth = Authenticator(parse_auth_config(tenant("a", "key-a") + tenant("b", "key-b", '"admin"')))
    assert auth.authenticate({"authorization": "Bearer key-a"}).tenant == "a"
    assert auth.authenticate({"authorization": "bearer key-b"}).admin
    for metadata in ({}, {"authorization": "Bearer nope"}, {"authorization": "key-a"}, {"authorization": "Bearer "}):
        with pytest.raises(UnauthenticatedError):
            auth.authenticate(metadata)
    auth.reload(parse_auth_config(tenant("b", "key-b2")))  # rotation: the old key stops working at once
    assert auth.authenticate({"authorization": "Bearer key-b2"}).tenant == "b"
    for old in ("key-a", "key-b"):
        with pytest.raises(UnauthenticatedError):
            auth.authenticate({"authorization": f"Bearer {old}"})


def test_without_an_auth_file_everyone_is_the_default_admin():
    principal = Authenticator(None).authenticate({})
    assert principal.tenant == "default" and principal.admin


def test_a_tenant_reads_its_own_namespace_then_public_names_and_writes_only_its_own():
    a = Namespace("a", admin=False)
    assert a.candidates("style") == ("a~style", "style")
    assert a.target("style") == "a~style"
    assert a.shown("a~style") == "style" and a.shown("upper") == "upper"
    assert a.shown("b~style") is None
    with pytest.raises(InvalidRequestError):
        a.check("b~style")  # a tenant can never name another's adapter
    ops = Namespace("ops", admin=True)
    assert ops.check("b~style") == "b~style" and ops.candidates("b~style") == ("b~style",)
    assert ops.target("upper") == "upper" and ops.shown("b~style") == "b~style"
    assert owner_of("b~style") == "b" and owner_of("upper") == ""


def test_max_concurrent_counts_slots_per_tenant():
    slots, limits = TenantSlots(), QuotaLimits(max_concurrent=2)
    slots.admit("a", limits)
    slots.admit("a", limits)
    with pytest.raises(SlotLimitError) as info:
        slots.admit("a", limits)
    assert info.value.status == "RESOURCE_EXHAUSTED" and info.value.retry_after_s > 0
    slots.admit("b", limits)  # another tenant is untouched
    slots.release("a")
    slots.admit("a", limits)
    assert slots.in_flight("a") == 2
    slots.admit("c", QuotaLimits(tokens_per_minute=1))  # token quotas are the scheduler's (test_quotas_cluster.py)
    slots.admit("c", QuotaLimits(tokens_per_minute=1))


@pytest.mark.parametrize(
    ("bind", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("127.0.0.2:1", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("0.0.0.0:50051", False),
        ("[::]:50051", False),
        ("10.0.0.5:50051", False),
        ("gateway:50051", False),
        (":50051", False),
    ],
)
def test_only_loopback_binds_may_go_without_keys(bind, loopback):
    assert is_loopback(bind) is loopback
    check_bind(bind, "auth.toml", False)
    check_bind(bind, None, True)
    if loopback:
        check_bind(bind, None, False)
    else:
        with pytest.raises(InvalidConfigError, match="--auth-file"):
            check_bind(bind, None, False)


def test_admin_actions_are_audited_with_their_outcome(caplog):
    from loraserve.errors import PermissionDeniedError
    from loraserve.gateway.audit import audited

    caplog.set_level("INFO", logger="loraserve.audit")
    with audited("upload") as record:
        record.tenant, record.adapter, record.version = "a", "a~style", 3
    with pytest.raises(PermissionDeniedError), audited("delete") as record:
        record.tenant = "viewer"
        raise PermissionDeniedError("no")
    lines = [r.getMessage() for r in caplog.records if r.name == "loraserve.audit"]
    assert lines == [
        "action=upload tenant=a adapter=a~style version=3 outcome=OK",
        "action=delete tenant=viewer adapter=- version=- outcome=PERMISSION_DENIED",
    ]


def test_a_new_key_and_its_table_round_trip():
    from loraserve.gateway.keys import new_key, tenant_table

    key, key_digest = new_key()
    config = parse_auth_config(tenant_table("newbie", key_digest, ["generate", "adapters"]))
    principal = Authenticator(config).authenticate({"authorization": f"Bearer {key}"})
    assert principal.tenant == "newbie" and Scope.ADAPTERS in principal.scopes and len(key) >= 40


def test_not_found_hints_never_name_a_tenants_adapter():
    from loraserve.errors import AdapterNotFoundError

    message = str(AdapterNotFoundError("x", ["public", "acme~secret", "other"]))
    assert "public" in message and "other" in message and "secret" not in message and "acme" not in message


def test_up_refuses_a_public_bind_without_auth_before_starting_anything():
    import subprocess
    import sys

    command = [sys.executable, "-m", "loraserve.cli", "up", "--bind", "0.0.0.0:1", "--base-port", "1"]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "without authentication" in result.stderr + result.stdout
    assert "started" not in result.stderr + result.stdout, "no role may have been started"
