"""A typed Python client of the public API (`loraserve.v1.LoraServe`), blocking and asyncio.

    from loraserve.client import Client

    with Client("127.0.0.1:50051", api_key="...") as client:
        print(client.generate("the quiet king", adapter="rot13", max_new_tokens=24).text)

`AsyncClient` has the same calls as coroutines (`stream` as an async iterator). Results are frozen
dataclasses, every failure an `ApiError` with the gRPC status name; each call has a deadline, and
calls safe to repeat are retried on UNAVAILABLE (see `RetryPolicy`).
"""

from loraserve.client.aio import AsyncClient
from loraserve.client.api import AdapterInfo, ApiError, Chunk, Generation, ModelInfo, Timings, Tokens, Usage
from loraserve.client.retry import Deadlines, RetryPolicy
from loraserve.client.sync import Client

__all__ = [
    "AdapterInfo",
    "ApiError",
    "AsyncClient",
    "Chunk",
    "Client",
    "Deadlines",
    "Generation",
    "ModelInfo",
    "RetryPolicy",
    "Timings",
    "Tokens",
    "Usage",
]
