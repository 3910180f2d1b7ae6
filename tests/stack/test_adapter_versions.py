"""Adapter versions pushed by the store (`AdapterStore.Watch`) into the gateway's cache.

The Watch stream of a real store process: the snapshot, `synced`, then each registration,
replacement and deletion; and the gateway's `AdapterVersions` applying what it is told.
"""

from __future__ import annotations

import queue
import threading

import pytest
from store_proc import StoreProcess, upload

from loraserve.gateway.adapter_versions import AdapterVersion, AdapterVersions
from loraserve.v1 import adapter_store_pb2, common_pb2, gateway_pb2

pytestmark = pytest.mark.slow


def _watch(store: StoreProcess) -> tuple[queue.Queue, threading.Thread]:
    changes: queue.Queue = queue.Queue()
    call = store.stub.Watch(adapter_store_pb2.WatchAdaptersRequest(), timeout=60)

    def read() -> None:
        try:
            for change in call:
                changes.put(change)
        except Exception as e:  # the call ends with the test
            changes.put(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.call = call
    return changes, thread


def _next(changes: queue.Queue) -> adapter_store_pb2.AdapterChange:
    change = changes.get(timeout=10)
    assert not isinstance(change, Exception), change
    return change


def test_a_watcher_gets_the_snapshot_then_every_change(tmp_path):
    store = StoreProcess(tmp_path, "--no-preload-demo").wait_serving()
    try:
        first = upload(store, "a", "upper")
        changes, thread = _watch(store)
        snapshot = _next(changes)
        assert (snapshot.name, snapshot.version, snapshot.sha256) == ("a", first.version, first.sha256)
        assert snapshot.rank == first.rank > 0  # the scheduler weighs requests by it
        assert _next(changes).synced
        second = upload(store, "a", "title")
        change = _next(changes)
        assert (change.name, change.version, change.sha256, change.rank) == (
            "a",
            second.version,
            second.sha256,
            second.rank,
        )
        upload(store, "b", "rot13")
        assert _next(changes).name == "b"
        store.stub.Delete(gateway_pb2.DeleteAdapterRequest(name="a"), timeout=10)
        change = _next(changes)
        assert change.name == "a" and change.deleted
        thread.call.cancel()
    finally:
        store.stop()


def test_the_cache_holds_what_it_was_told_and_a_resync_replaces_it_whole():
    versions = AdapterVersions()
    versions.apply(adapter_store_pb2.AdapterChange(name="a", version=3, sha256="aa"))
    assert versions.get("a") is None, "not synced yet: ask the store"
    versions.apply(adapter_store_pb2.AdapterChange(synced=True))
    assert versions.get("a") == AdapterVersion(3, "aa")
    versions.learned(common_pb2.AdapterInfo(name="a", version=4, sha256="bb"))  # uploaded through this gateway
    versions.apply(adapter_store_pb2.AdapterChange(name="a", version=4, sha256="bb"))
    assert versions.get("a") == AdapterVersion(4, "bb")
    versions.learned(common_pb2.AdapterInfo(name="a", version=2, sha256="old"))  # an older answer never wins
    assert versions.get("a") == AdapterVersion(4, "bb")
    versions.apply(adapter_store_pb2.AdapterChange(name="a", deleted=True))
    assert versions.get("a") is None
    versions.apply(adapter_store_pb2.AdapterChange(name="b", version=1, sha256="cc"))
    versions.apply(adapter_store_pb2.AdapterChange(name="c", version=1, sha256="dd"))
    versions.resubscribe()  # the store went away: what is known still serves
    assert versions.get("b") == AdapterVersion(1, "cc")
    versions.apply(adapter_store_pb2.AdapterChange(name="b", version=2, sha256="ee"))  # the new snapshot...
    assert versions.get("b") == AdapterVersion(1, "cc"), "...replaces the cache only once complete"
    versions.apply(adapter_store_pb2.AdapterChange(synced=True))
    assert versions.get("b") == AdapterVersion(2, "ee")
    assert versions.get("c") is None, "a name deleted while the watch was down is gone"
