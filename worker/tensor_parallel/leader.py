"""Rank 0 of a tensor-parallel worker: starts the other ranks and sends them each step before running it.

    leader = Leader.start(model_dir, config, device)     # spawns ranks 1..N-1, joins the process group
    pool = UnifiedPool(..., copier=SharingCopier)        # every adapter copy is also queued for the others
    runner = LeaderRunner(..., leader=leader)            # each step: the queued copies and the step, then its own
                                                         # (each other rank's part of a copy: to it alone)
    leader.ready(pool_pages, scratch_page)               # the others build their pools and runners

Rank 0 is the engine: it alone schedules, allocates pages, samples and talks to the scheduler and the
gateways. The other ranks (`follower.py`) hold their part of the weights, of the KV cache and of every
adapter (`loraserve/partition.py`) at the same pages, and run each step's forward pass with it, joining
its collectives (`collectives.py`). A rank that dies breaks the process group: rank 0's next collective
raises, and the worker fails as one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from loraserve.errors import InvalidConfigError
from loraserve.partition import Shard
from loraserve.worker.config import EngineConfig
from loraserve.worker.runner import ModelRunner
from loraserve.worker.step_runner import RunnerOutput
from loraserve.worker.step_scheduler import SeqChunk
from loraserve.worker.tensor_parallel.channel import Channel
from loraserve.worker.tensor_parallel.collectives import Collectives
from loraserve.worker.tensor_parallel.group import (
    JOIN_TIMEOUT,
    FollowerSettings,
    follower_command,
    free_port,
    init_process_group,
    rank_devices,
    share_cpus,
    wait_joined,
)
from loraserve.worker.tensor_parallel.loads import SharingCopier
from loraserve.worker.tensor_parallel.messages import Chunk, Load, Ready, Setup, Slot, Step, Stop

log = logging.getLogger(__name__)


class Leader:
    """Rank 0's side of the group: the other ranks' processes, the message channel and the collectives."""

    def __init__(self, shard: Shard, processes: list[subprocess.Popen], channel: Channel, devices: list[str]):
        self.shard, self.processes, self.channel, self.devices = shard, processes, channel, devices
        self.collectives = Collectives(shard)
        self.threads = torch.get_num_threads()  # this process's, before the ranks shared the cores

    @classmethod
    def start(cls, model_dir: str | Path, config: EngineConfig, device: torch.device) -> Leader:
        """Spawn ranks 1..N-1 (`python -m loraserve.worker.tensor_parallel.follower`), join the process group
        with them, and send them the model and the config to load while this rank loads its part."""
        size = config.tensor_parallel
        if dist.is_initialized():
            raise InvalidConfigError(
                "a process runs one tensor-parallel engine at a time (its process group): close the other first"
            )
        devices = rank_devices(device, size)
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False, timeout=JOIN_TIMEOUT)
        env = {**os.environ, "LORASERVE_DIE_WITH_PARENT": "1"}
        processes = [
            subprocess.Popen(follower_command(FollowerSettings(f"127.0.0.1:{port}", i, size, devices[i])), env=env)
            for i in range(1, size)
        ]
        try:
            wait_joined(store, processes)
        except RuntimeError:
            for process in processes:
                process.kill()
            raise
        init_process_group(store, Shard(size, 0), devices[0])
        leader = cls(Shard(size, 0), processes, Channel(), devices)
        share_cpus(devices[0], size)
        fields = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}
        leader.channel.send(Setup(str(model_dir), fields))
        log.info("tensor parallel: %d ranks on %s", size, ", ".join(devices))
        return leader

    def check(self) -> None:
        """RuntimeError when another rank's process has exited: the worker cannot step without it."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} of {self.shard.size} exited (code {code})")

    def ready(self, pool_pages: int, scratch_page: int | None) -> None:
        self.channel.send(Ready(pool_pages, scratch_page))

    def close(self) -> None:
        """Stop the other ranks and leave the process group."""
        try:
            self.channel.send(Stop())
        except RuntimeError as e:  # a rank is gone already
            log.warning("tensor parallel: the other ranks could not be told to stop: %s", e)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        dist.destroy_process_group()
        torch.set_num_threads(self.threads)


class LeaderRunner(ModelRunner):
    """Rank 0's model runner: each step goes to the other ranks, with the adapter copies made since the last
    one, before this rank runs it."""

    def __init__(self, *args, leader: Leader, copier: SharingCopier, **kwargs) -> None:
        super().__init__(*args, tp=leader.collectives, **kwargs)
        self.leader, self.copier = leader, copier

    def execute(self, batch: list[SeqChunk], kv_copies: Sequence[tuple[int, int]] = ()) -> RunnerOutput:
        self.leader.check()
        handovers = self.copier.drain()
        channel = self.leader.channel
        channel.send(step_message(batch, kv_copies, [h.load for h in handovers]))
        for handover in handovers:
            channel.send_rows(handover.rows)
        return super().execute(batch, kv_copies)


def step_message(batch: list[SeqChunk], kv_copies: Sequence[tuple[int, int]], loads: list[Load]) -> Step:
    slots: dict[int, int] = {}
    listed: list[Slot] = []
    chunks = []
    for c in batch:
        index = -1
        if c.adapter is not None:
            index = slots.setdefault(id(c.adapter), len(listed))
            if index == len(listed):
                a = c.adapter
                listed.append(
                    Slot(a.rank, a.scale, list(a.pages), list(a.a_offsets), list(a.b_offsets), list(a.layers))
                )
        chunks.append(Chunk(list(c.token_ids), c.start, list(c.kv_pages), index))
    return Step(loads, listed, chunks, [tuple(k) for k in kv_copies])
