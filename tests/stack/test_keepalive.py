"""Keepalive: every gRPC server of the project accepts the pings clients send while a connection
waits, idle or holding a long stream (a Watch). gRPC's default server policy (pings only while a call
is open, at most one per 5 minutes without data) answered the roles' own 20 s keepalive with GOAWAY
"too_many_pings", and callers got UNAVAILABLE "Too many pings" a minute or two after start-up.

The test runs a real store process and, as the control, an in-process server with gRPC's default
options: the same eager client must be thrown off the control (else it proves nothing) and never
off the store."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from store_proc import StoreProcess

from loraserve import grpc_utils

IDLE_S = 5.0  # the default policy throws a 1 s pinger off at its fourth ping
# A client pinging every second whether a call is open or not, with no limit on pings without data
# (grpc's client default stops after two; an HTTP/2 client of another language may not).
EAGER_CLIENT = [
    ("grpc.keepalive_time_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass
class Seen:
    """What an eager client saw of one server while its connections sat idle."""

    idle_states: list[grpc.ChannelConnectivity] = field(default_factory=list)  # leaving READY: a GOAWAY
    watch_status: tuple[grpc.StatusCode, str] | None = None  # None: the stream is still open
    call_after: grpc.StatusCode = grpc.StatusCode.OK


async def _states(channel: grpc.aio.Channel, into: list[grpc.ChannelConnectivity]) -> None:
    state = channel.get_state()
    while True:
        await channel.wait_for_state_change(state)
        state = channel.get_state()
        into.append(state)


async def _check(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()


async def _sit_idle(address: str) -> Seen:
    """Two eager channels: one idle after a first call, one holding an open Watch; then a call."""
    seen = Seen()
    async with (
        grpc.aio.insecure_channel(address, options=EAGER_CLIENT) as idle,
        grpc.aio.insecure_channel(address, options=EAGER_CLIENT) as watching,
    ):
        assert await _check(idle) == grpc.StatusCode.OK
        watch = health_pb2_grpc.HealthStub(watching).Watch(health_pb2.HealthCheckRequest())
        await watch.read()
        monitor = asyncio.create_task(_states(idle, seen.idle_states))
        await asyncio.sleep(IDLE_S)  # only pings cross the connections now
        monitor.cancel()
        if watch.done():
            seen.watch_status = (await watch.code(), await watch.details())
        watch.cancel()
        seen.call_after = await _check(idle)
    return seen


async def _default_server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()  # gRPC's own keepalive policy: what every role had
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def test_idle_and_waiting_connections_of_an_eager_client_are_never_sent_away(tmp_path):
    store = StoreProcess(tmp_path).wait_serving()

    async def scenario() -> tuple[Seen, Seen]:
        control, port = await _default_server()
        try:
            return await asyncio.gather(_sit_idle(store.address), _sit_idle(f"127.0.0.1:{port}"))
        finally:
            await control.stop(0)

    try:
        ours, default = asyncio.run(scenario())
    finally:
        store.stop()
    # The control: gRPC's default policy sends this client away (GOAWAY too_many_pings).
    assert default.watch_status is not None and default.watch_status[0] == grpc.StatusCode.UNAVAILABLE, default
    assert "Too many pings" in default.watch_status[1], default
    assert default.idle_states, default
    # The store: both connections stayed up all along, and a call after the idle time succeeds.
    assert ours.watch_status is None, ours
    assert ours.idle_states == [], ours
    assert ours.call_after == grpc.StatusCode.OK, ours


def test_the_roles_channels_ping_less_often_than_their_servers_accept():
    channel = dict(grpc_utils.CHANNEL_OPTIONS)
    server = dict(grpc_utils.SERVER_OPTIONS)
    assert channel["grpc.keepalive_time_ms"] >= 2 * server["grpc.http2.min_ping_interval_without_data_ms"]
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < dict(EAGER_CLIENT)["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.max_ping_strikes"] > 0  # a client pinging faster still gets sent away
