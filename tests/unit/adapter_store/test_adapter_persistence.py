"""The durable adapter store as plain objects: both backends, the catalog's layout and recovery, the
store's restore and preloads, and the content-hash checks between the store and a worker's cache.

Every test that makes sense for both backends runs on a data dir and on S3 (a moto server in this
process, on 127.0.0.1). "Restarting" is opening the same storage with a new backend and store.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
import zmq
from store_proc import files

from loraserve.adapter_store.catalog import Catalog, model_identity
from loraserve.adapter_store.client import AdapterFetcher
from loraserve.adapter_store.config import MIB, PersistenceConfig, StoreLimits, default_data_dir, stack_data_dir
from loraserve.adapter_store.data_plane import DataPlane
from loraserve.adapter_store.main import config_from_args
from loraserve.adapter_store.persistence import Backend, DirectoryBackend, StorageConfigError
from loraserve.adapter_store.s3 import S3Backend, parse_s3_url
from loraserve.adapter_store.store import AdapterStore
from loraserve.cli import build_parser
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.errors import (
    AdapterNotFoundError,
    DataLossError,
    LoraserveError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from loraserve.launcher.commands import add_arguments, role_commands
from loraserve.model_config import ModelConfig
from loraserve.sockets import make_socket, send
from loraserve.wire import AdapterPayload, decode
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.adapters import load_adapter_bytes

MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)
WEIGHTS = "adapter_model.safetensors"

Opener = Callable[[], Backend]


# ---- fixtures: storage that can be opened again ("a restart"); s3_endpoint is in conftest ------------
def new_bucket(endpoint: str) -> str:
    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture(params=["directory", "s3"])
def storage(request, tmp_path) -> Iterator[Opener]:
    """Opens the same storage again on every call, closing what the previous call opened."""
    opened: list[Backend] = []
    if request.param == "directory":

        def make() -> Backend:
            return DirectoryBackend(tmp_path / "data")
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = new_bucket(endpoint)

        def make() -> Backend:
            return S3Backend(f"s3://{bucket}/team/prod", endpoint)

    def reopen() -> Backend:
        while opened:
            opened.pop().close()
        opened.append(make())
        return opened[-1]

    yield reopen
    while opened:
        opened.pop().close()


def durable(backend: Backend, **limits) -> AdapterStore:
    """A store over `backend`, restored from it, as `loraserve adapter-store` starts one."""
    catalog = Catalog(backend)
    catalog.check_model(model_identity(MODEL))
    limits = {"budget_bytes": 64 * MIB, "max_adapter_bytes": 4 * MIB, "retention_s": 60.0, **limits}
    store = AdapterStore(MODEL, StoreLimits(**limits), catalog=catalog)
    store.restore()
    return store


def summary(store: AdapterStore) -> dict[str, tuple[int, str, str]]:
    return {r.name: (r.version, r.sha256, r.source) for r in store.list()}


# ---- the backends as plain objects ---------------------------------------------------------------------
def test_backend_put_get_delete_list_and_quarantine(storage):
    backend = storage()
    backend.put("adapters/a/v1/meta.json", b"{}")
    backend.put("adapters/a/v1/meta.json", b'{"x": 1}')  # replaced whole
    backend.put("top.json", b"")
    assert backend.get("adapters/a/v1/meta.json") == b'{"x": 1}' and backend.get("top.json") == b""
    assert backend.list_keys() == ["adapters/a/v1/meta.json", "top.json"]
    assert backend.list_keys(under="adapters/a") == ["adapters/a/v1/meta.json"]
    assert backend.list_keys(under="adapters/nothing") == []
    with pytest.raises(KeyError):
        backend.get("adapters/missing")
    backend.quarantine("adapters/a/v1/meta.json", "t0/adapters/a/v1/meta.json")
    assert backend.list_keys() == ["top.json"]  # quarantine/ is never listed
    backend.delete("top.json")
    backend.delete("top.json")  # absent: no error
    assert backend.list_keys() == []
    for bad in ("", "../x", "a//b", "a/./b", ".hidden", "a/.tmp"):
        with pytest.raises(ValueError):
            backend.put(bad, b"")


def test_directory_backend_writes_atomically_and_ignores_then_removes_temp_files(tmp_path, caplog):
    root = tmp_path / "data"
    backend = DirectoryBackend(root)
    backend.put("adapters/a/v1/meta.json", b"committed")
    backend.close()
    debris = root / "adapters" / "a" / "v1" / ".adapter_model.safetensors.1a2b3c4d.tmp"
    debris.write_bytes(b"half a file")  # what a crash mid-write leaves
    backend = DirectoryBackend(root)
    try:
        assert not debris.exists()
        assert "removed 1 temp file(s) left by an interrupted write" in caplog.text
        assert backend.list_keys() == ["adapters/a/v1/meta.json"]
        assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    finally:
        backend.close()


def test_directory_backend_full_disk_is_resource_exhausted_and_leaves_no_temp_file(tmp_path, monkeypatch):
    backend = DirectoryBackend(tmp_path / "data")
    try:

        def full(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", full)
        with pytest.raises(ResourceExhaustedError, match="is full"):
            backend.put("adapters/a/v1/meta.json", b"x" * 100)
        monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        with pytest.raises(UnavailableError, match="could not write"):
            backend.put("adapters/a/v1/meta.json", b"x")
        monkeypatch.undo()
        assert backend.list_keys() == []
        assert not [p for p in (tmp_path / "data").rglob("*") if p.is_file() and p.name != ".lock"]
    finally:
        backend.close()


def test_directory_backend_refuses_a_second_store_and_an_unusable_dir(tmp_path):
    first = DirectoryBackend(tmp_path / "data")
    try:
        with pytest.raises(StorageConfigError, match="in use by another adapter store"):
            DirectoryBackend(tmp_path / "data")
    finally:
        first.close()
    DirectoryBackend(tmp_path / "data").close()  # the lock went with the first backend
    (tmp_path / "a-file").write_text("")
    with pytest.raises(StorageConfigError, match="cannot create or open it"):
        DirectoryBackend(tmp_path / "a-file" / "data")


def test_s3_backend_refuses_a_missing_bucket_or_an_unreachable_endpoint(s3_endpoint):
    with pytest.raises(StorageConfigError, match="cannot be used"):
        S3Backend("s3://no-such-bucket/x", s3_endpoint)
    with pytest.raises(StorageConfigError, match="cannot be used"):
        S3Backend(f"s3://{new_bucket(s3_endpoint)}/x", "http://127.0.0.1:9")  # nothing listens on port 9


@pytest.mark.parametrize(
    ("url", "parsed"),
    [("s3://b", ("b", "")), ("s3://b/", ("b", "")), ("s3://b/a/b/", ("b", "a/b")), ("s3://b/x", ("b", "x"))],
)
def test_parse_s3_url(url, parsed):
    assert parse_s3_url(url) == parsed


@pytest.mark.parametrize("url", ["b/x", "http://b/x", "s3:///x", "s3://b/../x", "s3://b/x?y=1"])
def test_parse_s3_url_refuses(url):
    with pytest.raises((StorageConfigError, ValueError)):
        parse_s3_url(url)


def test_default_data_dirs_are_per_user_and_per_stack(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "loraserve" / "adapters"
    stack = stack_data_dir(7100, DEMO_MODEL_DIR)
    assert stack.parent == tmp_path / "loraserve" / "stacks" and stack.name.startswith("7100-")
    assert stack_data_dir(7100, DEMO_MODEL_DIR) == stack != stack_data_dir(7200, DEMO_MODEL_DIR)
    assert stack_data_dir(7100, tmp_path) != stack  # another model, another directory
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    assert default_data_dir() == Path.home() / ".local" / "share" / "loraserve" / "adapters"


# ---- the store over a catalog: restarts, versions, recovery ---------------------------------------------
def test_registered_adapters_survive_a_restart_with_the_same_versions_and_hashes(storage):
    store = durable(storage())
    store.register("a", *files("upper"))
    a2 = store.register("a", *files("title"))
    store.register("b", *files("reverse"), source="team/reverse")
    before = summary(store)
    assert before["a"][0] == 2
    store = durable(storage())
    assert summary(store) == before
    assert store.describe("a") == a2  # created time, rank, everything
    assert store.get_files("a", 2).weights == files("title")[1]
    with pytest.raises(NotFoundError, match="version 1 was released"):
        store.get_files("a", 1)  # superseded versions are not kept across a restart


def test_versions_stay_monotonic_across_deletes_and_restarts(storage):
    store = durable(storage())
    for _ in range(3):
        store.register("a", *files("upper"))
    assert store.delete("a") == 3
    store.register("b", *files("title"))
    store = durable(storage())
    assert set(summary(store)) == {"b"}
    with pytest.raises(AdapterNotFoundError):
        store.describe("a")
    assert store.register("a", *files("title")).version == 4  # never 1, never 3
    store = durable(storage())
    assert store.register("a", *files("upper")).version == 5


def test_a_corrupt_entry_is_quarantined_and_never_served_while_the_others_load(storage, caplog):
    backend = storage()
    store = durable(backend)
    store.register("good", *files("upper"))
    store.register("bad", *files("title"))
    weights = bytearray(backend.get(f"adapters/bad/v1/{WEIGHTS}"))
    weights[len(weights) // 2] ^= 0xFF  # one flipped bit of rot
    backend.put(f"adapters/bad/v1/{WEIGHTS}", bytes(weights))
    backend = storage()
    store = durable(backend)
    assert set(summary(store)) == {"good"}
    with pytest.raises(NotFoundError):
        store.get_files("bad", 1)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("bad v1 is not served: it is corrupt" in m and "does not match its sha256" in m for m in warned)
    assert not backend.list_keys(under="adapters/bad/v1")  # moved away, not deleted:
    quarantined = _quarantined(backend)
    assert any(k.endswith(f"adapters/bad/v1/{WEIGHTS}") for k in quarantined)
    assert any(k.endswith("adapters/bad/v1/reason.txt") for k in quarantined)
    assert store.register("bad", *files("title")).version == 2  # its number is not given out again


def test_an_interrupted_registration_is_quarantined_and_its_version_not_reused(storage):
    backend = storage()
    store = durable(backend)
    store.register("a", *files("upper"))
    config, weights = files("title")  # a crash after v2's files, before its meta.json (the commit point)
    backend.put("adapters/a/last_version.json", b'{"last_version": 2, "name": "a"}')
    backend.put("adapters/a/v2/adapter_config.json", config)
    backend.put(f"adapters/a/v2/{WEIGHTS}", weights)
    v1_objects = {k: backend.get(k) for k in backend.list_keys(under="adapters/a/v1")}
    backend = storage()
    store = durable(backend)
    assert summary(store)["a"][0] == 1
    assert backend.list_keys(under="adapters/a/v2") == []  # moved away, not deleted:
    assert {k.split("/", 1)[1] for k in _quarantined(backend)} >= {
        f"adapters/a/v2/{WEIGHTS}",
        "adapters/a/v2/reason.txt",
    }
    assert store.register("a", *files("title")).version == 3
    for key, data in v1_objects.items():  # a crash after v3's commit, before v1 was removed
        backend.put(key, data)
    backend = storage()
    store = durable(backend)
    assert summary(store)["a"][0] == 3
    assert backend.list_keys(under="adapters/a/v1") == []  # v3 passed every check: v1 was only superseded


def test_a_corrupt_newest_version_is_quarantined_and_the_good_older_one_keeps_serving(storage, caplog):
    backend = storage()
    store = durable(backend)
    store.register("a", *files("upper"))
    v1_objects = {k: backend.get(k) for k in backend.list_keys(under="adapters/a/v1")}
    store.register("a", *files("title"))
    for key, data in v1_objects.items():  # a crash after v2's commit, before v1 was removed ...
        backend.put(key, data)
    backend.put(f"adapters/a/v2/{WEIGHTS}", files("title")[1][:-1])  # ... and v2's weights lost a byte since
    backend = storage()
    store = durable(backend)
    assert summary(store)["a"][:2] == (1, hashlib.sha256(files("upper")[1]).hexdigest())
    assert {k: backend.get(k) for k in backend.list_keys(under="adapters/a/v1")} == v1_objects
    assert backend.list_keys(under="adapters/a/v2") == []
    assert any(k.endswith(f"adapters/a/v2/{WEIGHTS}") for k in _quarantined(backend))
    assert "serving a v1, its newest version that passes every check (newer: v2" in caplog.text
    assert store.register("a", *files("title")).version == 3  # v2's number is not given out again


def test_a_failed_write_fails_the_call_and_changes_nothing_served(storage, monkeypatch):
    backend = storage()
    store = durable(backend)
    store.register("a", *files("upper"))

    def broken(key, data):
        raise ResourceExhaustedError("the adapter store's storage is full")

    monkeypatch.setattr(backend, "put", broken)
    with pytest.raises(ResourceExhaustedError, match="is full"):
        store.register("a", *files("title"))
    assert summary(store)["a"][0] == 1 and store.stats().held_versions == 1
    monkeypatch.setattr(backend, "delete", lambda key: (_ for _ in ()).throw(UnavailableError("storage is down")))
    with pytest.raises(UnavailableError):
        store.delete("a")
    assert store.describe("a").version == 1  # still served: the delete was not kept
    monkeypatch.undo()
    assert store.register("a", *files("title")).version == 3  # the failed attempt's number stays burned
    assert summary(durable(storage()))["a"][0] == 3


def test_an_entry_over_lowered_limits_is_skipped_in_place_and_served_again_when_they_are_raised(storage, caplog):
    store = durable(storage())
    store.register("r4", *files("upper"))  # rank 4
    store.register("r8", *files("title"))  # rank 8
    store.register("big", *files("reverse"))  # 1.2 MiB
    before = summary(store)
    backend = storage()
    kept = {k: backend.get(k) for k in backend.list_keys()}
    store = durable(backend, max_lora_rank=4, max_adapter_bytes=1 * MIB)
    assert set(summary(store)) == {"r4"}
    assert {k: backend.get(k) for k in backend.list_keys()} == kept and not _quarantined(backend)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("not serving r8 v1" in m and "--max-lora-rank of 4" in m for m in warned)
    assert any("not serving big v1" in m and "--max-adapter-mb of 1.0 MiB" in m for m in warned)
    assert summary(durable(storage())) == before


def test_stored_adapters_over_the_memory_budget_are_a_start_up_error(storage):
    store = durable(storage())
    store.register("a", *files("reverse"))
    store.register("b", *files("reverse"))
    with pytest.raises(ResourceExhaustedError, match=r"restoring b v1 from .*host-RAM budget exhausted"):
        durable(storage(), budget_bytes=2 * MIB, max_adapter_bytes=2 * MIB)
    assert set(summary(durable(storage()))) == {"a", "b"}  # nothing was moved away


def test_storage_of_another_base_model_is_a_start_up_error(storage):
    durable(storage())
    catalog = Catalog(storage())
    with pytest.raises(StorageConfigError, match="holds adapters of another base model"):
        catalog.check_model({**model_identity(MODEL), "hidden_size": 4096})


def test_a_preload_keeps_its_version_while_its_files_are_unchanged(storage, tmp_path):
    directory = tmp_path / "preloaded"
    directory.mkdir()

    def write(adapter: str) -> None:
        for name, data in zip(("adapter_config.json", WEIGHTS), files(adapter), strict=True):
            (directory / name).write_bytes(data)

    write("upper")
    store = durable(storage())
    assert store.preload("p", directory).version == 1
    store = durable(storage())
    assert store.preload("p", directory).version == 1  # a restart with the same flags: no new version
    write("title")
    store = durable(storage())
    assert store.preload("p", directory).version == 2  # its files changed: a new version
    store.delete("p")
    store = durable(storage())
    assert store.preload("p", directory).version == 3  # deleted: registered again, under a new number


# ---- hashes between the store and a worker -------------------------------------------------------------
def test_the_data_plane_sends_the_hash_and_the_fetcher_checks_it():
    store = AdapterStore(MODEL, StoreLimits(budget_bytes=64 * MIB, max_adapter_bytes=4 * MIB))
    config, weights = files("upper")
    record = store.register("u", config, weights)
    plane = DataPlane(store, "tcp://127.0.0.1:*")
    plane.start()
    fetcher = AdapterFetcher(plane.endpoint, timeout_s=5)
    try:
        got = fetcher.fetch_adapter("u", 1)
        assert got.sha256 == record.sha256 == hashlib.sha256(weights).hexdigest()
        assert bytes(got.weights) == weights and got.config_json == config
    finally:
        fetcher.close()
        plane.stop()


@pytest.mark.parametrize(
    ("sha256", "message"), [("0" * 64, "hash to .*, not to the store's 0000"), ("", "without its sha256")]
)
def test_the_fetcher_refuses_weights_that_do_not_match_their_hash(sha256, message):
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    fetcher = AdapterFetcher(router.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=5)

    def answer():
        peer, *frames = router.recv_multipart()
        request = decode(frames)
        send(router, AdapterPayload(request.name, request.version, "safetensors", b"{}", b"w", sha256=sha256), to=peer)

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(DataLossError, match=message) as refused:
            fetcher.fetch_adapter("a", 1)
        assert refused.value.status == "DATA_LOSS"
    finally:
        thread.join()
        fetcher.close()
        router.close()


def test_the_worker_cache_treats_a_version_with_other_weights_as_a_miss():
    upper, title = files("upper"), files("title")
    sha_upper, sha_title = hashlib.sha256(upper[1]).hexdigest(), hashlib.sha256(title[1]).hexdigest()
    registry = AdapterRegistry(budget_bytes=64 * MIB)
    registry.register("x", load_adapter_bytes(*upper, MODEL, 64, sha256=sha_upper), version=1)
    assert registry.sha256(("x", 1)) == sha_upper
    assert registry.has(("x", 1), sha_upper) and registry.get(("x", 1), sha_upper).sha256 == sha_upper
    assert registry.has(("x", 1))  # without an expected hash: as before
    registry.hold(("x", 1))
    assert not registry.has(("x", 1), sha_title)  # stale, but held by a request: kept for it only
    assert registry.has(("x", 1))
    registry.release(("x", 1))
    with pytest.raises(KeyError):
        registry.get(("x", 1), sha_title)  # now unheld: dropped
    assert not registry.has(("x", 1)) and registry.names() == [] and registry.stale_drops == 2
    registry.register("x", load_adapter_bytes(*title, MODEL, 64, sha256=sha_title), version=1)
    assert registry.has(("x", 1), sha_title)
    registry.register("y", load_adapter_bytes(*upper, MODEL, 64), version=1)  # read from a path: no hash known
    assert not registry.has(("y", 1), sha_upper)


def _quarantined(backend: Backend) -> list[str]:
    """Keys under quarantine/, whichever the backend."""
    if isinstance(backend, DirectoryBackend):
        root = backend.root / "quarantine"
        return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    assert isinstance(backend, S3Backend)
    listed = backend._s3.list_objects_v2(Bucket=backend.bucket, Prefix=f"{backend.prefix}/quarantine/")
    return [item["Key"].split("/quarantine/", 1)[1] for item in listed.get("Contents", [])]


def test_demo_adapters_are_all_storable(tmp_path):
    """Every demo adapter round-trips through a data dir (the default `up` preloads them all)."""
    backend = DirectoryBackend(tmp_path / "data")
    store = durable(backend, max_adapter_bytes=8 * MIB)
    for name, directory in demo_adapters().items():
        store.preload(name, directory)
    backend.close()
    backend = DirectoryBackend(tmp_path / "data")
    try:
        assert {r.name: r.version for r in durable(backend, max_adapter_bytes=8 * MIB).list()} == dict.fromkeys(
            demo_adapters(), 1
        )
    finally:
        backend.close()


# ---- flags: the CLI is always durable; `up` gives each stack its own data dir ----------------------------
def _store_config(*argv: str):
    args = build_parser("adapter-store").parse_args(["adapter-store", *argv])
    return config_from_args(args).persistence


def test_store_flags_and_their_env_twins_choose_the_storage(monkeypatch, tmp_path):
    for var in ("LORASERVE_DATA_DIR", "LORASERVE_OBJECT_STORE", "LORASERVE_OBJECT_STORE_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert _store_config() == PersistenceConfig(data_dir=default_data_dir())  # durable by default
    assert _store_config("--data-dir", str(tmp_path)).data_dir == tmp_path
    monkeypatch.setenv("LORASERVE_DATA_DIR", str(tmp_path / "env"))
    assert _store_config().data_dir == tmp_path / "env"
    assert _store_config("--data-dir", str(tmp_path)).data_dir == tmp_path  # the flag wins
    monkeypatch.setenv("LORASERVE_OBJECT_STORE", "s3://bucket/prod")
    monkeypatch.setenv("LORASERVE_OBJECT_STORE_ENDPOINT", "http://127.0.0.1:9000")
    assert _store_config() == PersistenceConfig(
        object_store="s3://bucket/prod", object_store_endpoint="http://127.0.0.1:9000"
    )
    monkeypatch.delenv("LORASERVE_OBJECT_STORE")
    with pytest.raises(LoraserveError, match="--object-store is not"):
        _store_config()
    with pytest.raises(LoraserveError, match="must be an s3://"):
        PersistenceConfig(object_store="gs://bucket")


def test_up_gives_its_store_a_data_dir_per_stack(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def data_dir(*argv: str) -> str:
        store = role_commands(parser.parse_args(list(argv)))["adapter-store"]
        return store[store.index("--data-dir") + 1]

    assert data_dir("--base-port", "7400") == str(stack_data_dir(7400, DEMO_MODEL_DIR))
    assert data_dir("--base-port", "7400", "--data-dir", str(tmp_path)) == str(tmp_path)
