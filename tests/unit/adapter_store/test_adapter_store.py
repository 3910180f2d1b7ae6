"""The adapter store's pure parts: the store and its version table, path confinement, upload assembly,
and the fetch client."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import threading
from pathlib import Path

import pytest
import torch
import zmq
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from loraserve.adapter_store.client import AdapterFetcher
from loraserve.adapter_store.config import MIB, StoreLimits
from loraserve.adapter_store.data_plane import DataPlane
from loraserve.adapter_store.files import AdapterFiles
from loraserve.adapter_store.packing import RowsMaker
from loraserve.adapter_store.store import AdapterStore, NoAdapterRootError
from loraserve.adapter_store.upload import UploadAssembler
from loraserve.adapter_store.validation import AdapterRecord
from loraserve.adapter_store.versions import Held, StoreStats, VersionTable
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.errors import (
    AdapterNotFoundError,
    InvalidAdapterError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TooLargeError,
    UnavailableError,
)
from loraserve.model_config import ModelConfig
from loraserve.partition import Shard, local_model
from loraserve.sockets import make_socket, send
from loraserve.wire import AdapterPayload, AdapterRows, FetchAdapter, decode
from loraserve.worker.adapters import load_adapter_bytes
from loraserve.worker.pool_layout import PoolLayout

MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)


def files(name: str) -> tuple[bytes, bytes]:
    directory = demo_adapters()[name]
    return (directory / "adapter_config.json").read_bytes(), (directory / "adapter_model.safetensors").read_bytes()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(root: Path | None = None, **limits) -> tuple[AdapterStore, Clock]:
    clock = Clock()
    limits = {"budget_bytes": 64 * MIB, "max_adapter_bytes": 4 * MIB, "retention_s": 60.0, **limits}
    return AdapterStore(MODEL, StoreLimits(**limits), adapter_root=root, clock=clock), clock


# ---- registering, versions, retention ------------------------------------------------------------
def test_register_describes_the_adapter_and_serves_the_same_bytes():
    store, _ = make_store()
    config, weights = files("title")
    record = store.register("title", config, weights)
    assert (record.name, record.version, record.rank) == ("title", 1, 8)
    assert record.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert record.layers == tuple(range(MODEL.num_layers))
    assert record.scale == pytest.approx(json.loads(config)["lora_alpha"] / 8)
    assert record.sha256 == hashlib.sha256(weights).hexdigest()
    assert (record.size_bytes, record.source) == (len(weights), "upload")
    held = store.get_files("title", 1)
    assert held.weights is weights and held.config_json is config  # no copies: what workers get is what came in
    assert store.describe("title") == record
    assert store.stats().used_bytes == len(config) + len(weights)


def test_reregistering_makes_a_new_version_and_the_old_one_stays_fetchable_until_retention_ends():
    store, clock = make_store(retention_s=60.0)
    store.register("a", *files("upper"))
    store.register("b", *files("title"))
    v2 = store.register("a", *files("title"))
    assert v2.version == 2 and store.describe("a").version == 2
    assert [r.name for r in store.list()] == ["a", "b"]
    assert store.get_files("a", 1).weights == files("upper")[1]  # a request in flight still gets v1
    used = store.stats().used_bytes
    clock.now += 59
    assert store.get_files("a", 1)
    clock.now += 2
    with pytest.raises(NotFoundError, match="version 1 was released"):
        store.get_files("a", 1)
    assert store.stats().used_bytes == used - sum(map(len, files("upper")))
    with pytest.raises(NotFoundError, match="version 7 never existed"):
        store.get_files("a", 7)


def test_delete_keeps_the_version_fetchable_and_versions_are_never_reused():
    store, clock = make_store()
    store.register("a", *files("upper"))
    assert store.delete("a") == 1
    with pytest.raises(NotFoundError, match="not registered"):
        store.describe("a")
    assert store.list() == []
    assert store.get_files("a", 1)
    assert store.register("a", *files("title")).version == 2  # (a, 1) keeps meaning the deleted bytes
    clock.now += 61
    with pytest.raises(NotFoundError, match="released"):
        store.get_files("a", 1)
    with pytest.raises(NotFoundError, match="not registered"):
        store.delete("nope")
    with pytest.raises(NotFoundError, match="not registered"):
        store.get_files("nope", 1)


def test_zero_retention_drops_superseded_versions_at_once():
    store, _ = make_store(retention_s=0.0)
    store.register("a", *files("upper"))
    store.register("a", *files("upper"))
    assert store.stats().held_versions == 1


@pytest.mark.parametrize("name", ["", "-x", ".x", "a/b", "a b", "x" * 129, "naïve", "a\n", "../etc"])
def test_bad_names_are_refused_naming_the_field(name):
    store, _ = make_store()
    with pytest.raises(InvalidRequestError) as e:
        store.register(name, *files("upper"))
    assert e.value.field == "name"


def test_longest_valid_name_is_accepted():
    store, _ = make_store()
    assert store.register("A" + "b.c_d-" * 21 + "x", *files("upper")).version == 1


def nan_weights() -> bytes:
    tensors = load_safetensors(files("upper")[1])
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    return save_safetensors(tensors)


@pytest.mark.parametrize(
    ("config", "weights", "message"),
    [
        (b"{not json", None, "not valid JSON"),
        (None, b"garbage", "not a valid safetensors file"),
        (None, "nan", "NaN or infinite"),
        (json.dumps({"r": 4, "target_modules": ["q_proj", "v_proj"], "use_dora": True}).encode(), None, "DoRA"),
        (json.dumps({"r": 4, "target_modules": ["q_proj"]}).encode(), None, "does not target"),
    ],
)
def test_invalid_adapters_are_refused_with_the_engines_rules(config, weights, message):
    store, _ = make_store()
    good_config, good_weights = files("upper")
    weights = nan_weights() if weights == "nan" else weights
    with pytest.raises(InvalidAdapterError, match=message):
        store.register("bad", config or good_config, weights or good_weights)
    assert store.list() == [] and store.stats().used_bytes == 0


def test_rank_above_the_store_maximum_is_refused():
    store, _ = make_store(max_lora_rank=4)
    with pytest.raises(InvalidAdapterError, match="exceeds this server's max_lora_rank 4"):
        store.register("t", *files("title"))


def test_bin_weights_are_read_safely_and_served_as_bin():
    store, _ = make_store()
    config, weights = files("upper")
    buffer = io.BytesIO()
    torch.save(load_safetensors(weights), buffer)
    record = store.register("b", config, buffer.getvalue(), weights_format="bin")
    assert record.rank == 4 and store.get_files("b", 1).weights_format == "bin"


# ---- limits --------------------------------------------------------------------------------------
def test_an_adapter_over_the_size_limit_is_refused_stating_sizes():
    store, _ = make_store(max_adapter_bytes=100_000)
    config, weights = files("reverse")
    with pytest.raises(TooLargeError, match=rf"\({len(weights)} bytes\) exceed .* \(100000 bytes\)") as refused:
        store.register("r", config, weights)
    assert refused.value.status == "INVALID_ARGUMENT" and "--max-adapter-mb" in str(refused.value)  # not retried


def test_the_memory_budget_counts_retired_versions_until_they_are_purged():
    config, weights = files("snake")
    size = len(config) + len(weights)
    store, clock = make_store(budget_bytes=2 * size + 10, max_adapter_bytes=size)
    store.register("s", config, weights)
    store.register("s", config, weights)  # v1 retired but still held
    with pytest.raises(ResourceExhaustedError, match=r"budget exhausted.*1 superseded or deleted"):
        store.register("t", config, weights)
    clock.now += 61
    assert store.register("t", config, weights).version == 1


# ---- the version table: no locks, no clock, `now` given ------------------------------------------
def held(name: str, version: int, nbytes: int = 100) -> Held:
    record = AdapterRecord(name, version, 8, 16.0, 2.0, ("q_proj",), (0,), nbytes - 10, 0.0, "upload", "0" * 64)
    return Held(record, AdapterFiles(b"c" * 10, b"w" * (nbytes - 10), "safetensors"))


def test_the_version_table_retires_the_previous_version_and_drops_it_when_its_retention_is_over():
    table = VersionTable(StoreLimits(budget_bytes=4 * MIB, max_adapter_bytes=MIB, retention_s=60.0))
    assert table.add(held("a", table.next_version("a"), 100), now=0.0) == []
    assert table.add(held("a", table.next_version("a"), 300), now=10.0) == []  # v1 retires at 10
    assert (table.current_record("a").version, table.get("a", 1).retired_at) == (2, 10.0)
    assert table.stats() == StoreStats(1, 2, 1, 400, 100, 4 * MIB, MIB)
    assert table.purge(now=69.9) == []
    assert [h.record.version for h in table.purge(now=70.0)] == [1]
    assert (table.get("a", 1), table.used) == (None, 300)
    assert "version 1 was released" in str(table.not_held("a", 1))
    assert "version 3 never existed" in str(table.not_held("a", 3))


def test_the_version_table_never_gives_a_number_out_twice():
    table = VersionTable(StoreLimits(retention_s=0.0))
    table.add(held("a", table.next_version("a")), now=0.0)
    version, dropped = table.remove("a", now=1.0)  # zero retention: dropped at once
    assert (version, [h.record.version for h in dropped], table.records()) == (1, [1], [])
    assert "adapter 'a' was deleted" in str(table.not_held("a", 1))
    assert table.next_version("a") == 2
    table.raise_last_versions({"a": 7, "b": 3})  # the storage's high-water marks
    table.raise_last_versions({"a": 5})  # never lowered
    assert (table.next_version("a"), table.next_version("b"), table.next_version("c")) == (8, 4, 1)
    with pytest.raises(AdapterNotFoundError):
        table.current_record("a")


def test_the_version_table_refuses_what_exceeds_the_budget_naming_the_retired_bytes():
    table = VersionTable(StoreLimits(budget_bytes=1000, max_adapter_bytes=500, retention_s=60.0))
    table.add(held("a", 1, 400), now=0.0)
    table.add(held("a", 2, 400), now=0.0)
    table.check_fits(200)
    with pytest.raises(ResourceExhaustedError, match=r"budget exhausted.*by 1 superseded or deleted"):
        table.check_fits(201)


# ---- paths ---------------------------------------------------------------------------------------
@pytest.fixture
def adapter_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "team").mkdir(parents=True)
    for name in ("upper", "title"):
        target = root / "team" / name
        target.mkdir()
        config, weights = files(name)
        (target / "adapter_config.json").write_bytes(config)
        (target / "adapter_model.safetensors").write_bytes(weights)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_bytes(files("upper")[0])
    (outside / "adapter_model.safetensors").write_bytes(files("upper")[1])
    (root / "escape").symlink_to(outside, target_is_directory=True)
    sneaky = root / "sneaky"
    sneaky.mkdir()
    (sneaky / "adapter_config.json").write_bytes(files("upper")[0])
    (sneaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    (root / "inner-link").symlink_to(root / "team" / "upper", target_is_directory=True)
    (root / "file").write_text("x")
    return root


def test_register_from_path_reads_below_the_root(adapter_root):
    store, _ = make_store(adapter_root)
    record = store.register_from_path("u", "team/upper")
    assert (record.rank, record.source) == (4, "team/upper")
    assert store.register_from_path("u", "inner-link").version == 2  # symlinks that stay inside are fine


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("/etc", InvalidRequestError, "absolute"),
        ("../outside", InvalidRequestError, r"'\.\.'"),
        ("team/../../outside", InvalidRequestError, r"'\.\.'"),
        ("", InvalidRequestError, "required"),
        ("escape", PermissionDeniedError, "outside the adapter root"),
        ("sneaky", PermissionDeniedError, "outside the adapter root"),
        ("missing", NotFoundError, "no such directory"),
        ("file", InvalidRequestError, "not a directory"),
        ("team", InvalidRequestError, "has no adapter_config.json"),
    ],
)
def test_register_from_path_refuses_every_way_out(adapter_root, path, error, message):
    store, _ = make_store(adapter_root)
    with pytest.raises(error, match=message):
        store.register_from_path("x", path)
    assert store.list() == []


def test_register_from_path_needs_a_root():
    store, _ = make_store(None)
    with pytest.raises(NoAdapterRootError, match="no --adapter-root configured") as e:
        store.register_from_path("x", "team/upper")
    assert e.value.status == "FAILED_PRECONDITION"


def test_concurrent_registrations_get_distinct_versions():
    store, _ = make_store()
    config, weights = files("upper")
    threads = [threading.Thread(target=store.register, args=("c", config, weights)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.describe("c").version == 4
    assert {store.get_files("c", v).weights_format for v in range(1, 5)} == {"safetensors"}


# ---- upload assembly -----------------------------------------------------------------------------
def test_upload_assembles_interleaved_chunks():
    config, weights = files("upper")
    upload = UploadAssembler(max_weights_bytes=MIB)
    upload.header("u")
    upload.chunk("adapter_model.safetensors", weights[:1000])
    upload.chunk("adapter_config.json", config)
    upload.chunk("adapter_model.safetensors", weights[1000:])
    done = upload.finish()
    assert (done.name, done.config_json, done.weights, done.weights_format) == ("u", config, weights, "safetensors")


@pytest.mark.parametrize(
    ("steps", "error", "message"),
    [
        ([("chunk", "adapter_config.json", b"{}")], InvalidRequestError, "header: missing"),
        ([("header", "a"), ("header", "b")], InvalidRequestError, "sent twice"),
        ([("header", "a"), ("chunk", "model.pt", b"x")], InvalidRequestError, "unknown file 'model.pt'"),
        ([("header", "a/b")], InvalidRequestError, "header.name"),
        ([("header", "a"), ("chunk", "adapter_config.json", b" " * (MIB + 1))], InvalidRequestError, "larger than"),
        (
            [("header", "a"), ("chunk", "adapter_model.bin", b"x" * 600), ("chunk", "adapter_model.bin", b"x" * 600)],
            TooLargeError,
            r"\(1200 bytes\) exceed .* \(1000 bytes\)",
        ),
        (
            [("header", "a"), ("chunk", "adapter_model.bin", b"x"), ("chunk", "adapter_model.safetensors", b"x")],
            InvalidRequestError,
            "not both",
        ),
        (
            [("header", "a"), ("chunk", "adapter_model.safetensors", b"x"), ("finish",)],
            InvalidRequestError,
            "adapter_config.json: missing",
        ),
        (
            [("header", "a"), ("chunk", "adapter_config.json", b"{}"), ("finish",)],
            InvalidRequestError,
            "adapter_model.safetensors: missing",
        ),
        ([("finish",)], InvalidRequestError, "stream was empty"),
    ],
)
def test_upload_refuses_bad_streams_at_the_message_at_fault(steps, error, message):
    upload = UploadAssembler(max_weights_bytes=1000)
    with pytest.raises(error, match=message):
        for kind, *args in steps:
            getattr(upload, kind)(*args)


# ---- the data plane and its client, in-process -----------------------------------------------------
def test_fetch_over_the_data_plane_and_errors():
    store, _ = make_store()
    config, weights = files("upper")
    store.register("u", config, weights)
    plane = DataPlane(store, "tcp://127.0.0.1:*")
    plane.start()
    fetcher = AdapterFetcher(plane.endpoint, timeout_s=5)
    try:
        got_config, got_weights, fmt = fetcher.fetch("u", 1, trace={"traceparent": "garbage"})
        assert (got_config, bytes(got_weights), fmt) == (config, weights, "safetensors")
        with pytest.raises(NotFoundError, match="never existed"):
            fetcher.fetch("u", 2)
    finally:
        fetcher.close()
        plane.stop()


def test_a_tensor_parallel_rank_fetches_its_own_part_of_the_rows():
    """The store cuts each rank's part from its whole rows for the reply: the bytes a rank would pack itself,
    under their own layer digests (checked by the fetcher); a part this model has not is refused, naming why."""
    store = AdapterStore(MODEL, StoreLimits(max_adapter_bytes=MIB, budget_bytes=64 * MIB), rows=RowsMaker(MODEL, None))
    config, weights = files("upper")
    store.register("u", config, weights)
    adapter = load_adapter_bytes(config, weights, MODEL, 64)  # the worker's own packing, in torch
    plane = DataPlane(store, "tcp://127.0.0.1:*")
    plane.start()
    fetcher = AdapterFetcher(plane.endpoint, timeout_s=5)
    try:
        for shard in (Shard(2, 0), Shard(2, 1)):
            width = local_model(MODEL, shard).kv_width
            got = fetcher.fetch_rows("u", 1, width, MODEL.num_layers, shard=shard)
            own = adapter.pack(PoolLayout.for_model(MODEL, 2, 1, shard), MODEL, torch.float32)
            assert (got.header.tp_size, got.header.tp_rank) == (shard.size, shard.index)
            assert bytes(got.rows) == own.numpy().tobytes() and own.nbytes < store.get_rows("u", 1)[2].spec.nbytes
        with pytest.raises(InvalidAdapterError, match="tensor_parallel 3 does not divide the model's num_attention"):
            fetcher.fetch_rows("u", 1, MODEL.kv_width, MODEL.num_layers, shard=Shard(3, 1))
        refused = plane._answer(FetchAdapter("u", 1, row_width=MODEL.kv_width, num_layers=4, tp_size=2, tp_rank=2))
        assert (refused.status, refused.error) == ("INVALID_ARGUMENT", "tensor-parallel rank 2 of 2 is not a rank")
    finally:
        fetcher.close()
        plane.stop()


def test_a_rank_asking_a_store_that_cuts_no_parts_gets_the_files():
    """A store that answers a part's request with its whole rows (one that knows no parts): the files instead."""
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    fetcher = AdapterFetcher(router.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=5)
    whole = AdapterRows("a", 1, "ab" * 32, 4, ["q_proj"], [0], "float32", 1, 8, 64, ["cd" * 32], rows=bytes(2048))

    def answer():
        for reply in (whole, files_reply("a", 1, b"weights")):
            peer, *frames = router.recv_multipart()
            assert isinstance(decode(frames), FetchAdapter)
            send(router, reply, to=peer)

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        got = fetcher.fetch_rows("a", 1, 64, 1, shard=Shard(2, 1))
        assert bytes(got.weights) == b"weights"
    finally:
        thread.join()
        fetcher.close()
        router.close()


def files_reply(name: str, version: int, weights: bytes) -> AdapterPayload:
    """What a store sends: the files and the weights' sha256."""
    return AdapterPayload(name, version, "safetensors", b"{}", weights, sha256=hashlib.sha256(weights).hexdigest())


def test_fetcher_times_out_and_never_takes_a_late_reply_for_the_next_fetch():
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    fetcher = AdapterFetcher(address, timeout_s=0.3)
    try:
        with pytest.raises(UnavailableError, match=r"did not send a v1 within 0\.3 s"):
            fetcher.fetch("a", 1)
        peer = router.recv_multipart()[0]
        late = files_reply("a", 1, b"late")
        with contextlib.suppress(zmq.ZMQError):  # the timed-out socket is closed: the reply goes nowhere
            send(router, late, to=peer, flags=zmq.NOBLOCK)

        def answer():
            peer, *frames = router.recv_multipart()
            request = decode(frames)
            send(router, late, to=peer)  # a stale key first: must be skipped
            send(router, files_reply(request.name, request.version, b"fresh"), to=peer)

        thread = threading.Thread(target=answer)
        thread.start()
        assert bytes(fetcher.fetch("a", 2)[1]) == b"fresh"
        thread.join()
    finally:
        fetcher.close()
        router.close()


def test_a_store_flooding_malformed_replies_cannot_flood_the_fetchers_log(caplog):
    ctx = zmq.Context.instance()
    router = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    fetcher = AdapterFetcher(router.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=5)

    def answer():
        peer, *frames = router.recv_multipart()
        request = decode(frames)
        for i in range(200):
            router.send_multipart([peer, b"\xff", b"garbage %d" % i])
        send(router, files_reply(request.name, request.version, b"real"), to=peer)

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="loraserve.adapter_store.client"):
            assert bytes(fetcher.fetch("a", 1)[1]) == b"real"
    finally:
        thread.join()
        fetcher.close()
        router.close()
    dropped = [r for r in caplog.records if "malformed reply" in r.getMessage()]
    assert 1 <= len(dropped) <= 5, f"{len(dropped)} log lines for 200 malformed replies"
