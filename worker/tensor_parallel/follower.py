"""Ranks 1..N-1 of a tensor-parallel worker: load a part of the model, then run each step rank 0 sends.

    python -m loraserve.worker.tensor_parallel.follower --init 127.0.0.1:PORT --rank I --size N --device D
    (its flags: `FollowerSettings`; rank 0 writes them with `follower_argv`)

Rank 0 (`leader.py`) starts these processes; a follower never talks to the scheduler, the store or a
gateway. It holds its part of the weights, of the KV cache and of every adapter at the pages rank 0
chose (`loraserve/partition.py`), and runs each step's forward pass, joining its collectives; it samples
nothing. It exits when rank 0 says Stop, or with an error when the process group breaks (rank 0 gone).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import torch

from loraserve.config_cli import add_config_arguments, config_from_args
from loraserve.kernels.backend import select_backend
from loraserve.model_config import ModelConfig
from loraserve.partition import Shard
from loraserve.process import die_with_parent
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine_setup import backend_name
from loraserve.worker.model import load_model
from loraserve.worker.pool_copier import PoolCopier
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.runner import DecodePadding, ModelRunner, step_capacity
from loraserve.worker.step_scheduler import SeqChunk
from loraserve.worker.tensor_parallel.channel import Channel
from loraserve.worker.tensor_parallel.collectives import Collectives
from loraserve.worker.tensor_parallel.group import FollowerSettings, init_process_group, join_store, share_cpus
from loraserve.worker.tensor_parallel.loads import adapter_of
from loraserve.worker.tensor_parallel.messages import Ready, Setup, Step, Stop


class Follower:
    """One rank's model, pool and runner, driven by rank 0's messages."""

    def __init__(self, shard: Shard, device: torch.device, setup: Setup):
        self.shard, self.device = shard, device
        self.config = EngineConfig(**setup.engine)
        self.model_config = ModelConfig.from_dir(setup.model_dir)
        self.dtype = self.config.torch_dtype(device, self.model_config.torch_dtype)
        self.model = load_model(setup.model_dir, self.model_config, device, self.dtype, shard)
        self.copier: PoolCopier | None = None
        self.runner: ModelRunner | None = None

    def build(self, ready: Ready, collectives: Collectives) -> None:
        config, model = self.config, self.model_config
        layout = PoolLayout.for_model(model, config.rows_per_page, ready.pool_pages, self.shard)
        self.copier = PoolCopier(layout, model, self.dtype, self.device, copy_threads=1)
        max_model_len = config.max_model_len or model.max_position_embeddings
        padding = None
        if ready.scratch_page is not None:
            padding = DecodePadding(tuple(config.decode_buckets()), ready.scratch_page)
        backend = select_backend(backend_name(config), self.device)
        capacity = step_capacity(config, layout, model, max_model_len)
        self.runner = ModelRunner(self.model, self.copier.tensor, layout, backend, capacity, padding, collectives)

    def step(self, step: Step, channel: Channel) -> None:
        for load in step.loads:  # each load's rows for this rank follow the message, in order
            rows = channel.receive_rows(getattr(torch, load.dtype), load.shape)
            self.copier.copy(tuple(load.pages), load.num_rows, adapter_of(load, rows, self.shard))
        slots = step.slots  # each as the kernels read an adapter (`kernels.batch.PooledAdapter`)
        batch = [
            SeqChunk("", c.token_ids, c.start, c.kv_pages, None if c.slot < 0 else slots[c.slot], None)
            for c in step.chunks
        ]
        self.runner.execute(batch, step.kv_copies)


def serve(shard: Shard, device: torch.device, init: str) -> None:
    init_process_group(join_store(init, shard), shard, str(device))
    share_cpus(str(device), shard.size)
    channel = Channel()
    setup = channel.receive()
    if not isinstance(setup, Setup):
        raise RuntimeError(f"rank 0 sent {type(setup).__name__} before Setup")
    follower = Follower(shard, device, setup)
    collectives = Collectives(shard)
    while True:
        message = channel.receive()
        if isinstance(message, Ready):
            follower.build(message, collectives)
        elif isinstance(message, Step):
            follower.step(message, channel)
        elif isinstance(message, Stop):
            break
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, FollowerSettings)
    settings = config_from_args(FollowerSettings, parser.parse_args(argv))
    if os.environ.get("LORASERVE_DIE_WITH_PARENT") == "1":
        die_with_parent(signal.SIGTERM)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {settings.rank} %(levelname)s %(message)s")
    with torch.inference_mode():
        serve(Shard(settings.size, settings.rank), torch.device(settings.device or "cpu"), settings.init)
    return 0


if __name__ == "__main__":
    sys.exit(main())
