"""Rows in shared memory (`loraserve/shared_memory.py`) between a real store process and a worker's fetcher.

- A worker on the store's host and user maps the store's file: the same bytes as over the socket, none sent.
- A file it cannot take (a directory others may enter, a symlink, a wrong size, token or hash, a name that
  would leave the directory) is refused; the fetcher then takes the rows over the socket and says so once.
- A store started with `--shared-memory-root ''` sends rows over the socket; with `--no-adapter-rows`, files.
- The store removes a version's file when the version goes, its directory when it stops, and the
  directories of stores that died.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from store_proc import StoreProcess

from loraserve.adapter_store.client import AdapterFetcher, FetchedAdapter, FetchedRows
from loraserve.adapter_store.config import StoreLimits
from loraserve.adapter_store.packing import RowsMaker
from loraserve.adapter_store.store import AdapterStore
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.errors import ResourceExhaustedError
from loraserve.model_config import ModelConfig
from loraserve.shared_memory import SharedMemoryUnavailable, SharedRowsDir, open_rows, user_dir

MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)
SHA = hashlib.sha256(b"weights").hexdigest()


def _file(root: Path, nbytes: int = 4096):
    shared = SharedRowsDir(root)
    made = shared.create(nbytes, SHA)
    made.rows[:] = bytes(range(256)) * (nbytes // 256)
    return shared, made


def test_a_file_maps_back_the_same_rows_and_nothing_else_passes(tmp_path):
    shared, made = _file(tmp_path)
    base = user_dir(tmp_path)
    assert bytes(open_rows(base, made.name, made.token, SHA, 4096)) == bytes(made.rows)
    refused = [
        (made.name, "0" * 32, SHA, 4096),  # another store's token
        (made.name, made.token, "0" * 64, 4096),  # another version's weights
        (made.name, made.token, SHA, 8192),  # another size
        ("../" + made.name, made.token, SHA, 4096),  # out of the directory
        (made.name.replace(".rows", ".txt"), made.token, SHA, 4096),
    ]
    for name, token, sha, nbytes in refused:
        with pytest.raises(SharedMemoryUnavailable):
            open_rows(base, name, token, sha, nbytes)
    os.chmod(made.path, 0o644)  # others could read it
    with pytest.raises(SharedMemoryUnavailable, match="private"):
        open_rows(base, made.name, made.token, SHA, 4096)
    os.chmod(made.path, 0o600)
    os.chmod(shared.path, 0o755)  # others could enter the store's directory
    with pytest.raises(SharedMemoryUnavailable, match="private"):
        open_rows(base, made.name, made.token, SHA, 4096)
    os.chmod(shared.path, 0o700)
    target = made.path.with_name("0" * 32 + ".rows")
    made.path.rename(target)
    made.path.symlink_to(target)  # a symlink where the file was
    with pytest.raises(SharedMemoryUnavailable):
        open_rows(base, made.name, made.token, SHA, 4096)
    shared.close()
    assert not shared.path.exists()


def test_a_mapping_outlives_the_unlink_and_dead_stores_directories_are_removed(tmp_path):
    shared, made = _file(tmp_path)
    rows = open_rows(user_dir(tmp_path), made.name, made.token, SHA, 4096)
    made.unlink()
    assert not made.path.exists() and bytes(rows[:4]) == bytes(range(4))  # the worker's mapping stays valid
    dead = user_dir(tmp_path) / "p999999999-0123abcd"  # no such process
    dead.mkdir(mode=0o700)
    SharedRowsDir(tmp_path)  # a new store on the host cleans up after dead ones, never after live ones
    assert not dead.exists() and shared.path.exists()
    shared.close()


def test_a_users_directory_others_may_enter_is_not_used(tmp_path):
    user_dir(tmp_path).mkdir(mode=0o755)
    os.chmod(user_dir(tmp_path), 0o755)
    with pytest.raises(SharedMemoryUnavailable, match="private"):
        SharedRowsDir(tmp_path)


def test_the_store_removes_a_versions_file_when_the_version_goes(tmp_path):
    rows = RowsMaker(MODEL, tmp_path)
    store = AdapterStore(MODEL, StoreLimits(retention_s=0.0), rows=rows)
    directory = demo_adapters()["upper"]
    config = (directory / "adapter_config.json").read_bytes()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    store.register("u", config, weights)
    packed = store.get_rows("u", 1)[2]
    assert packed is not None and packed.file.path.exists() and packed.spec.nbytes == len(packed.buffer)
    store.register("u", config, weights)  # v2: v1 retires, and with no retention it goes at once
    assert not packed.file.path.exists() and store.get_rows("u", 2)[2].file.path.exists()
    rows.close()
    assert not rows.shared.path.exists()


def test_the_memory_budget_counts_each_versions_rows_beside_its_files(tmp_path):
    """Rows are host RAM too (shared memory is RAM): `--memory-budget-gb` holds files and rows together."""
    directory = demo_adapters()["upper"]
    config = (directory / "adapter_config.json").read_bytes()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    rows = RowsMaker(MODEL, tmp_path)
    files_only = len(config) + len(weights)
    store = AdapterStore(MODEL, StoreLimits(retention_s=0.0), rows=rows)
    store.register("u", config, weights)
    packed = store.get_rows("u", 1)[2]
    assert store.stats().used_bytes == files_only + len(packed.buffer)
    store.register("u", config, weights)  # v2 replaces v1 (no retention): one version's files and rows
    assert store.stats().used_bytes == files_only + packed.spec.nbytes  # v1 (and its file) is gone
    tight = AdapterStore(MODEL, StoreLimits(budget_bytes=files_only + 10, max_adapter_bytes=files_only), rows=rows)
    with pytest.raises(ResourceExhaustedError, match="budget exhausted"):
        tight.register("u", config, weights)  # its files fit, its rows do not
    rows.close()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A real store with shared memory under its own root, one with sockets only, and one without rows."""
    tmp = tmp_path_factory.mktemp("shared-rows")
    root = tmp / "shm"
    root.mkdir()
    made = {
        "shared": StoreProcess(tmp, "--shared-memory-root", str(root)),
        "sockets": StoreProcess(tmp, "--shared-memory-root", ""),
        "files": StoreProcess(tmp, "--no-adapter-rows"),
    }
    try:
        yield root, {name: store.wait_serving() for name, store in made.items()}
    finally:
        for store in made.values():
            store.stop()


def test_rows_come_by_shared_memory_on_the_same_host_else_over_the_socket(stores, tmp_path, caplog):
    root, running = stores
    shape = (MODEL.kv_width, MODEL.num_layers)
    address = running["shared"].data_address
    mapped = AdapterFetcher(address, 5.0, shared_memory=user_dir(root))
    socket_only = AdapterFetcher(address, 5.0)
    elsewhere = AdapterFetcher(address, 5.0, shared_memory=user_dir(tmp_path))  # another host's view: no such file
    try:
        got = mapped.fetch_rows("upper", 1, *shape)
        assert isinstance(got, FetchedRows) and got.shared
        over_socket = socket_only.fetch_rows("upper", 1, *shape)
        assert isinstance(over_socket, FetchedRows) and not over_socket.shared
        assert bytes(got.rows) == bytes(over_socket.rows)
        fallback = elsewhere.fetch_rows("upper", 1, *shape)
        assert isinstance(fallback, FetchedRows) and not fallback.shared and bytes(fallback.rows) == bytes(got.rows)
        assert elsewhere.shared_memory is None and "using the socket" in caplog.text  # not offered again
    finally:
        for fetcher in (mapped, socket_only, elsewhere):
            fetcher.close()
    plain = AdapterFetcher(running["sockets"].data_address, 5.0, shared_memory=user_dir(root))
    files = AdapterFetcher(running["files"].data_address, 5.0, shared_memory=user_dir(root))
    try:
        got = plain.fetch_rows("upper", 1, *shape)
        assert isinstance(got, FetchedRows) and not got.shared
        assert isinstance(files.fetch_rows("upper", 1, *shape), FetchedAdapter)
        assert isinstance(plain.fetch_rows("upper", 1, MODEL.kv_width * 2, MODEL.num_layers), FetchedAdapter)
    finally:
        plain.close()
        files.close()
    running["shared"].stop()
    assert not any(user_dir(root).iterdir())  # the stopped store removed its directory


def test_a_full_shared_memory_keeps_the_rows_in_ram(tmp_path, monkeypatch, caplog):
    rows = RowsMaker(MODEL, tmp_path)

    def full(nbytes, sha256):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rows.shared, "create", full)
    store = AdapterStore(MODEL, StoreLimits(), rows=rows)
    directory = demo_adapters()["upper"]
    store.register(
        "u", (directory / "adapter_config.json").read_bytes(), (directory / "adapter_model.safetensors").read_bytes()
    )
    packed = store.get_rows("u", 1)[2]
    assert packed.file is None and len(packed.buffer) == packed.spec.nbytes and any(bytes(packed.buffer))
    assert "kept in RAM" in caplog.text
    rows.close()
