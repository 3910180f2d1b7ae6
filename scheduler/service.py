"""The scheduler's gRPC control plane: Submit, Cancel, GetClusterState, PrepareAdapter."""

from __future__ import annotations

import math
import time

import grpc

from loraserve.grpc_utils import RETRY_AFTER_KEY
from loraserve.scheduler.cluster_state import cluster_state
from loraserve.scheduler.loop import SchedulerLoop
from loraserve.scheduler.quotas import QuotaExceededError
from loraserve.scheduler.submit import spec_from_submit
from loraserve.v1 import scheduler_pb2, scheduler_pb2_grpc


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """The scheduler's gRPC control plane: each call goes straight to the `SchedulerLoop`."""

    def __init__(self, loop: SchedulerLoop):
        self.loop = loop

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        try:
            spec = spec_from_submit(request, time.time())  # the request's one record from here on
            position = self.loop.submit(spec, request.tokens_per_minute, context.invocation_metadata())
        except QuotaExceededError as e:  # the gateway passes the hint on to its client
            if e.retry_after_s is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(math.ceil(e.retry_after_s * 1000))),))
            raise
        return scheduler_pb2.SubmitResponse(queue_position=position, instance=self.loop.instance)

    async def Cancel(self, request: scheduler_pb2.CancelRequest, context: grpc.aio.ServicerContext):
        return scheduler_pb2.CancelResponse(found=self.loop.cancel(request.request_id, request.reason))

    async def GetClusterState(self, request, context: grpc.aio.ServicerContext):
        return cluster_state(self.loop.policy, self.loop.instance)

    async def PrepareAdapter(self, request: scheduler_pb2.PrepareAdapterRequest, context: grpc.aio.ServicerContext):
        worker_id = self.loop.prepare_adapter(request, context.invocation_metadata())
        return scheduler_pb2.PrepareAdapterResponse(worker_id=worker_id)
