"""The scheduler's gRPC control plane: Submit, Cancel, GetClusterState."""

from __future__ import annotations

import grpc

from loraserve.scheduler.loop import SchedulerLoop
from loraserve.v1 import scheduler_pb2, scheduler_pb2_grpc


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """The scheduler's gRPC control plane: each call goes straight to the `SchedulerLoop`."""

    def __init__(self, loop: SchedulerLoop):
        self.loop = loop

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        position = self.loop.submit(request, context.invocation_metadata())
        return scheduler_pb2.SubmitResponse(queue_position=position, instance=self.loop.instance)

    async def Cancel(self, request: scheduler_pb2.CancelRequest, context: grpc.aio.ServicerContext):
        return scheduler_pb2.CancelResponse(found=self.loop.cancel(request.request_id, request.reason))

    async def GetClusterState(self, request, context: grpc.aio.ServicerContext):
        return self.loop.cluster_state()
