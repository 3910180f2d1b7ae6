"""gRPC server reflection under both names clients use: grpc.reflection.v1 and grpc.reflection.v1alpha.

grpcio-reflection implements only v1alpha, which newer clients (grpcurl, Postman, grpcui, gRPC's
own CLI) ask for last or not at all. The v1 protocol is v1alpha under a new package name: the same
messages with the same field numbers, so the same bytes on the wire. The v1 service is therefore
one more handler for the same servicer, whose messages it (de)serializes with v1alpha's classes,
and its proto file is v1alpha's descriptor renamed (`_v1_file`), so that a client can describe it
like any other listed service.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _v1_file() -> None:
    """Add grpc/reflection/v1/reflection.proto to the default descriptor pool (once): v1alpha's file,
    package and type references renamed."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # proto2: assigning "" would mark a scalar field as typed
                field.type_name = field.type_name.replace(old, new, 1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    pool.Add(proto)


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Serve reflection of `service_names` (and of the reflection services themselves) as v1 and v1alpha."""
    _v1_file()
    servicer = ReflectionServicer([*service_names, V1_SERVICE, V1ALPHA_SERVICE])
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": info})
            for name in (V1_SERVICE, V1ALPHA_SERVICE)
        ]
    )
