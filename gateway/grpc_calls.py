"""The public gRPC service (`loraserve.v1.LoraServe`) assembled from its parts, and what a part reads
from a call.

Each part (generation, model and tokenizer, adapter admin) is a class of its own that defines some of
the service's RPCs by name; `add_loraserve` serves all of them as the one service, on one server.
"""

from __future__ import annotations

import time

import grpc

from loraserve.v1 import gateway_pb2, gateway_pb2_grpc

RPCS = tuple(m.name for m in gateway_pb2.DESCRIPTOR.services_by_name["LoraServe"].methods)


def add_loraserve(server: grpc.aio.Server, *parts: object) -> None:
    """Serve `LoraServe` on `server`, each RPC by the one part that defines it (every RPC by one)."""
    owners = {name: [p for p in parts if callable(getattr(p, name, None))] for name in RPCS}
    wrong = {name: len(found) for name, found in owners.items() if len(found) != 1}
    if wrong:
        raise ValueError(f"each LoraServe RPC needs exactly one part, got {wrong}")
    service = gateway_pb2_grpc.LoraServeServicer()
    for name, (part,) in owners.items():
        setattr(service, name, getattr(part, name))
    gateway_pb2_grpc.add_LoraServeServicer_to_server(service, server)


def metadata_of(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """A call's metadata (its keys are lower-case), binary values left out."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """A call's deadline (unix time), or None without one."""
    remaining = context.time_remaining()
    return time.time() + remaining if remaining is not None else None
