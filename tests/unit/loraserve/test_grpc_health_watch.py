"""Streaming handlers that write with context.write (grpc_health's Watch) pass the error interceptor.

The interceptor wrapped every streaming handler as an async generator; Watch is a coroutine that
writes its responses itself, so every role answered health Watch with INTERNAL.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.grpc_utils import add_health_and_reflection, new_server, set_serving


def test_health_watch_streams_the_status():
    async def scenario() -> list[int]:
        server, port = new_server("127.0.0.1:0")
        servicer = add_health_and_reflection(server, ["loraserve.v1.Test"])
        await server.start()
        await set_serving(servicer, ["loraserve.v1.Test"], True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                call = stub.Watch(health_pb2.HealthCheckRequest(service="loraserve.v1.Test"), timeout=5)
                first = await call.read()
                await set_serving(servicer, ["loraserve.v1.Test"], False)
                second = await call.read()
                call.cancel()
                return [first.status, second.status]
        finally:
            await server.stop(0)

    serving, not_serving = asyncio.run(scenario())
    assert serving == health_pb2.HealthCheckResponse.SERVING
    assert not_serving == health_pb2.HealthCheckResponse.NOT_SERVING
