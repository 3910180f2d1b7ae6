"""The durable adapter store as real processes: `kill -9` and restart on the same data dir or bucket,
corruption on disk, debris of an interrupted write, and a whole stack whose store loses a name and
gets it back with other weights (the worker must never serve the old ones)."""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3
import grpc
import pytest
import zmq
from stack import LocalStack
from store_proc import StoreProcess, files, upload, upload_requests

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import NotFoundError
from loraserve.launcher.ports import free_port_block
from loraserve.launcher.up import wait_healthy
from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.sockets import make_socket, send
from loraserve.v1 import gateway_pb2
from loraserve.wire import AdapterPayload, Assign, Tokens, WorkerReport, decode

pytestmark = pytest.mark.timeout(240)
WEIGHTS = "adapter_model.safetensors"
NO_DEMO = ("--model", str(DEMO_MODEL_DIR), "--no-preload-demo")


def start(tmp: Path, data_dir: Path, *flags: str) -> StoreProcess:
    return StoreProcess(tmp, *NO_DEMO, "--data-dir", str(data_dir), *flags).wait_serving()


def described(store: StoreProcess) -> dict[str, tuple[int, str]]:
    return {name: (info.version, info.sha256) for name, info in store.listed().items()}


def test_kill_9_then_restart_serves_the_same_versions_and_bytes_and_never_reuses_a_number(tmp_path):
    data = tmp_path / "data"
    store = start(tmp_path, data)
    try:
        upload(store, "a", "upper")
        assert upload(store, "a", "title").version == 2
        upload(store, "b", "reverse")
        upload(store, "gone", "upper")
        store.stub.Delete(gateway_pb2.DeleteAdapterRequest(name="gone"), timeout=5)
        before = described(store)
    finally:
        store.kill()
    store = start(tmp_path, data)
    try:
        assert described(store) == before
        assert before["a"] == (2, hashlib.sha256(files("title")[1]).hexdigest())
        config, weights, _ = store.fetcher.fetch("a", 2)
        assert (config, bytes(weights)) == files("title")
        assert upload(store, "gone", "title").version == 2  # deleted at v1 before the crash: never v1 again
        store.stub.Delete(gateway_pb2.DeleteAdapterRequest(name="a"), timeout=5)
    finally:
        store.kill()
    store = start(tmp_path, data)
    try:
        assert "a" not in store.listed()
        assert upload(store, "a", "reverse").version == 3
    finally:
        store.stop()


def test_a_corrupt_file_and_files_without_meta_are_quarantined_and_crash_debris_removed_while_the_rest_loads(
    tmp_path,
):
    data = tmp_path / "data"
    store = start(tmp_path, data)
    try:
        upload(store, "good", "upper")
        upload(store, "bad", "title")
    finally:
        store.kill()
    weights = data / "adapters" / "bad" / "v1" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated on disk
    debris = data / "adapters" / "good" / "v1" / f".{WEIGHTS}.0badc0de.tmp"
    debris.write_bytes(b"half written")
    never_committed = data / "adapters" / "good" / "v2"
    never_committed.mkdir()
    shutil.copy(data / "adapters" / "good" / "v1" / WEIGHTS, never_committed / WEIGHTS)
    store = start(tmp_path, data)
    try:
        assert set(store.listed()) == {"good"}
        with pytest.raises(NotFoundError, match="'bad'"):
            store.fetcher.fetch("bad", 1)
        assert bytes(store.fetcher.fetch("good", 1)[1]) == files("upper")[1]
        assert not debris.exists() and not never_committed.exists()
        moved = sorted(p.as_posix().split("/adapters/", 1)[1] for p in (data / "quarantine").rglob(WEIGHTS))
        assert moved == [f"bad/v1/{WEIGHTS}", f"good/v2/{WEIGHTS}"]  # moved, never deleted
        assert "WARNING loraserve.adapter_store.catalog" in store.output()
        assert "bad v1 is not served: it is corrupt" in store.output()
        assert upload(store, "bad", "title").version == 2
        assert upload(store, "good", "title").version == 3  # v2 was begun once: its number stays used
    finally:
        store.stop()


def test_an_unusable_data_dir_is_a_clear_start_up_error(tmp_path):
    (tmp_path / "file").write_text("")
    store = StoreProcess(tmp_path, *NO_DEMO, "--data-dir", str(tmp_path / "file" / "data"))
    try:
        assert store.proc.wait(60) == 1
        assert "cannot create or open it" in store.output()
    finally:
        store.stop()
    first = start(tmp_path, tmp_path / "shared")
    second = StoreProcess(tmp_path, *NO_DEMO, "--data-dir", str(tmp_path / "shared"))
    try:
        assert second.proc.wait(60) == 1
        assert "in use by another adapter store" in second.output()
    finally:
        second.stop()
        first.stop()


def test_the_object_store_backend_survives_kill_9(tmp_path, s3_endpoint):
    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    flags = (*NO_DEMO, "--object-store", f"s3://{bucket}/prod", "--object-store-endpoint", s3_endpoint)
    store = StoreProcess(tmp_path, *flags).wait_serving()
    try:
        upload(store, "a", "upper")
        upload(store, "a", "title")
        store.stub.Delete(gateway_pb2.DeleteAdapterRequest(name="a"), timeout=5)
        upload(store, "b", "reverse")
        before = described(store)
    finally:
        store.kill()
    store = StoreProcess(tmp_path, *flags).wait_serving()
    try:
        assert described(store) == before
        assert upload(store, "a", "upper").version == 3
        listed = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]
        keys = [item["Key"] for item in listed]
        assert "prod/adapters/a/v3/meta.json" in keys and "prod/store.json" in keys
    finally:
        store.stop()


# ---- a whole stack: a store restart never makes a worker serve old weights ------------------------------
def _tokens(stack: LocalStack, adapter: str) -> list[int]:
    request = gateway_pb2.GenerateRequest(adapter=adapter, text="the quiet king", max_new_tokens=12)  # greedy
    return list(stack.api.Generate(request, timeout=60).token_ids)


def _restart_store(stack: LocalStack, wipe: Path | None = None) -> None:
    """Kill -9 the store (then delete `wipe`, its data, when given), restart it, and wait until the gateway
    reaches it again."""
    store = stack.process("adapter-store")
    store.send_signal(signal.SIGKILL)
    store.wait(10)
    if wipe is not None:
        shutil.rmtree(wipe)
    stack.stack.restart("adapter-store")
    wait_healthy([stack.ports.store], stack.stack, timeout_s=120)
    deadline = time.monotonic() + 10  # and until the gateway reaches it again (reconnect backoff <= 1 s)
    while True:
        try:
            stack.api.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=5)
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the gateway did not reach the restarted store"
            time.sleep(0.1)


def _upload(stack: LocalStack, name: str, adapter: str) -> int:
    config, weights = files(adapter)
    parts = [("adapter_config.json", config), (WEIGHTS, weights)]
    return stack.api.UploadAdapter(upload_requests(name, parts), timeout=60).version


@pytest.mark.slow
def test_a_stack_keeps_its_adapters_across_a_store_crash_and_never_serves_stale_weights(tmp_path):
    stack = LocalStack(DEMO_MODEL_DIR, 1, data_dir=str(tmp_path / "stack-data")).start()
    try:
        title, upper = _tokens(stack, "title"), _tokens(stack, "upper")
        assert title != upper
        assert _upload(stack, "x", "title") == 1
        assert _tokens(stack, "x") == title  # the worker now caches (x, 1)
        _restart_store(stack)
        info = stack.api.DescribeAdapter(gateway_pb2.DescribeAdapterRequest(name="x"), timeout=10)
        assert (info.version, info.sha256) == (1, hashlib.sha256(files("title")[1]).hexdigest())
        assert _tokens(stack, "x") == title
        stack.api.DeleteAdapter(gateway_pb2.DeleteAdapterRequest(name="x"), timeout=10)
        _restart_store(stack)
        with pytest.raises(grpc.RpcError) as gone:
            _tokens(stack, "x")
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        assert _upload(stack, "x", "upper") == 2  # a RAM-only store said 1 here, and the worker served title
        assert _tokens(stack, "x") == upper
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_worker_never_serves_cached_weights_whose_hash_the_store_no_longer_has(tmp_path):
    """The store's data is lost (a wiped volume): a version number comes back with other weights.
    Workers key their caches by content hash as well, so they fetch the new weights."""
    data = tmp_path / "stack-data"
    stack = LocalStack(DEMO_MODEL_DIR, 1, data_dir=str(data)).start()
    try:
        title, upper = _tokens(stack, "title"), _tokens(stack, "upper")
        assert _upload(stack, "x", "title") == 1
        assert _tokens(stack, "x") == title  # the worker now caches (x, 1) with title's weights
        _restart_store(stack, wipe=data)  # an upload sent before the gateway reconnects may be told to retry
        assert _upload(stack, "x", "upper") == 1  # the same (name, version), other weights
        assert _tokens(stack, "x") == upper
    finally:
        stack.stop()


# ---- a worker refuses weights that do not hash to what the store sent ----------------------------------
def test_a_worker_fails_the_requests_of_a_fetch_whose_bytes_do_not_match_their_hash(tmp_path):
    """A real worker, a fake scheduler and a fake store that corrupts one adapter in flight."""
    base = free_port_block(2)
    scheduler_address, store_address = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    ctx = zmq.Context()
    scheduler = make_socket(ctx, zmq.ROUTER, bind=scheduler_address)
    fake_store = make_socket(ctx, zmq.ROUTER, bind=store_address)
    sink = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*")
    stop = threading.Event()
    config, weights = files("upper")

    def serve() -> None:  # "ok" with the right hash, "rotten" with another one
        while not stop.is_set():
            if fake_store.poll(100):
                peer, *frames = fake_store.recv_multipart()
                fetch = decode(frames)
                sha = hashlib.sha256(weights).hexdigest() if fetch.name == "ok" else "0" * 64
                send(
                    fake_store, AdapterPayload(fetch.name, fetch.version, "safetensors", config, weights, sha), to=peer
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    command = [
        sys.executable,
        "-m",
        "loraserve.cli",
        "--log-level",
        "WARNING",
        "worker",
        "--model",
        str(DEMO_MODEL_DIR),
        "--worker-id",
        "w",
        "--device",
        "cpu",
        "--scheduler-address",
        scheduler_address,
        "--store-address",
        store_address,
        "--pool-pages",
        "256",
        "--torch-threads",
        "1",
    ]
    with (tmp_path / "worker.log").open("wb") as log:
        worker = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not any(isinstance(decode(f[1:]), WorkerReport) and decode(f[1:]).ready for f in _recv_all(scheduler)):
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
        outcome = {}
        for request_id in ("rotten", "ok"):
            sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)
            reply_to = sink.getsockopt_string(zmq.LAST_ENDPOINT)
            spec = RequestSpec(
                request_id, [1, 5, 9], sampling, reply_to, time.time(), adapter=request_id, adapter_version=1
            )
            assign = Assign(spec)
            send(scheduler, assign, to=b"w")
            while request_id not in outcome:
                _recv_all(scheduler)
                assert sink.poll(60_000), f"no tokens for {request_id}"
                message = decode(sink.recv_multipart())
                if isinstance(message, Tokens) and message.finished:
                    outcome[message.request_id] = (message.error_status, message.error, len(message.token_ids))
        status, error, _ = outcome["rotten"]
        assert status == "DATA_LOSS" and "not to the store's 0000" in error
        assert outcome["ok"][0] is None
        assert worker.poll() is None  # an error for that fetch, not a crash
    finally:
        stop.set()
        worker.terminate()
        worker.wait(20)
        thread.join(5)
        for sock in (scheduler, fake_store, sink):
            sock.close(linger=0)
        ctx.term()


def _recv_all(sock: zmq.Socket) -> list[list[bytes]]:
    """Everything waiting on `sock` (after at most 0.1 s for the first message)."""
    received = []
    while sock.poll(100 if not received else 0):
        received.append(sock.recv_multipart())
    return received
