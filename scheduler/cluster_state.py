"""`GetClusterState`'s answer: each worker as its last report described it, and the queue (protobuf: the edge)."""

from __future__ import annotations

import time

from loraserve.scheduler.policy import SchedulerPolicy
from loraserve.v1 import scheduler_pb2


def cluster_state(policy: SchedulerPolicy, instance: str) -> scheduler_pb2.ClusterState:
    """The cluster as `policy` sees it now; `instance` tells gateways a restarted scheduler."""
    now = time.time()
    workers = []
    for view in policy.workers.values():
        r = view.report
        workers.append(
            scheduler_pb2.WorkerState(
                worker_id=r.worker_id,
                ready=r.ready,
                running=len(r.running),
                waiting=len(r.waiting),
                max_batch_size=r.max_batch_size,
                free_pages=r.free_pages,
                total_pages=r.total_pages,
                kv_pages=r.kv_pages,
                adapter_pages=r.adapter_pages,
                resident_adapters=sorted(f"{n}@{v}" for n, v in view.resident),
                last_report_age_s=now - view.last_report,
                prefetch_hits=r.prefetch_hits,
                prefetch_misses=r.prefetch_misses,
                steps=r.steps,
                pool_waste_fraction=r.waste_fraction,
                draining=r.draining,
            )
        )
    return scheduler_pb2.ClusterState(
        workers=workers,
        queue_length=len(policy.queue),
        max_queue_length=policy.max_queue_length,
        instance=instance,
    )
