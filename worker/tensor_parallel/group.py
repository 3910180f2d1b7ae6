"""The process group of a tensor-parallel worker's ranks: devices, rendezvous, start-up, CPU threads.

Rank 0 opens a rendezvous store (torch.distributed's TCPStore) on a free loopback port and starts the
other ranks with its address; each says it joined, and rank 0 waits for all of them while watching
their processes (one that exits fails the start at once), then every rank joins the process group:
NCCL on CUDA, one device per rank, gloo on the CPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from loraserve.config_cli import config_to_argv, setting
from loraserve.errors import InvalidConfigError
from loraserve.partition import Shard

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a step's collective waiting longer: a rank is lost
JOIN_TIMEOUT = timedelta(minutes=5)  # the other ranks' start-up (a Python process importing torch)
JOINED = "joined"  # the rendezvous store's count of ranks started


@dataclass(frozen=True)
class FollowerSettings:
    """The command line rank 0 starts each other rank with (`follower.py`)."""

    init: str = setting("127.0.0.1:29500", "rank 0's rendezvous store (host:port)")
    rank: int = setting(1, "this process's rank")
    size: int = setting(2, "ranks in all")
    device: str = setting("", "this rank's device (cuda:N; empty: the CPU)")


def follower_command(settings: FollowerSettings) -> list[str]:
    return [sys.executable, "-m", "loraserve.worker.tensor_parallel.follower", *config_to_argv(settings)]


def rank_devices(device: torch.device, size: int) -> list[str]:
    """Each rank's device: one CUDA device per rank from `device` on, or the CPU for all."""
    if device.type != "cuda":
        return ["cpu"] * size
    first = device.index or 0
    if first + size > torch.cuda.device_count():
        raise InvalidConfigError(f"tensor_parallel {size} from {device} needs {first + size} CUDA devices")
    return [f"cuda:{first + i}" for i in range(size)]


def init_process_group(store: dist.Store, shard: Shard, device: str) -> None:
    """Join the worker's process group: NCCL for the collectives on CUDA, gloo on the CPU."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=store, rank=shard.index, world_size=shard.size, timeout=COLLECTIVE_TIMEOUT)


def join_store(address: str, shard: Shard) -> dist.TCPStore:
    """Ranks 1..N-1: connect to rank 0's rendezvous store (`host:port`) and say so."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), shard.size, is_master=False, timeout=JOIN_TIMEOUT)
    store.add(JOINED, 1)
    return store


def wait_joined(store: dist.TCPStore, processes: list[subprocess.Popen]) -> None:
    """Until every other rank has joined; RuntimeError at once when one exits first (its log says why)."""
    deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
    while store.add(JOINED, 0) < len(processes):
        for rank, process in enumerate(processes, start=1):
            if process.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (code {process.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not start within {JOIN_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.05)


def share_cpus(device: str, size: int) -> None:
    """On the CPU, the ranks share the machine's cores: each computes on its share of them, or on fewer threads
    if this process was given fewer (more threads than cores leave each rank's collectives waiting on the
    others' compute)."""
    if device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // size)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
