"""Keepalive: every gRPC server of the project accepts the pings clients send while a connection
waits (a long Watch stream, an idle channel). gRPC's default server policy, one ping per 5 minutes
without data, answered the roles' own 20 s keepalive with GOAWAY "too_many_pings", and callers got
UNAVAILABLE "Too many pings" a minute or two after start-up."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve import grpc_utils

IDLE_S = 5.0
# A client pinging as often as the servers allow, and with no limit on pings without data (grpc's
# client default stops after two; an HTTP/2 client of another language may not).
EAGER_CLIENT = [
    ("grpc.keepalive_time_ms", int(1.5 * grpc_utils.MIN_PING_INTERVAL_MS)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def test_a_stream_that_waits_survives_a_client_pinging_as_often_as_servers_allow():
    async def scenario() -> int:
        server, port = grpc_utils.new_server("127.0.0.1:0")
        health = grpc_utils.add_health_and_reflection(server, [])
        await server.start()
        try:
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=EAGER_CLIENT) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                await asyncio.sleep(IDLE_S)  # only pings cross the connection now
                await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                return (await asyncio.wait_for(watch.read(), 5)).status  # raises UNAVAILABLE after a GOAWAY
        finally:
            await server.stop(0)

    assert asyncio.run(scenario()) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_roles_channels_ping_less_often_than_their_servers_accept():
    channel = dict(grpc_utils.CHANNEL_OPTIONS)
    server = dict(grpc_utils.SERVER_OPTIONS)
    assert channel["grpc.keepalive_time_ms"] >= 2 * server["grpc.http2.min_ping_interval_without_data_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == 1
